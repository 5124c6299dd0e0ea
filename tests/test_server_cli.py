"""`hf-accel serve` end to end in a subprocess: the reference target by default (here int8-quantized), the API key,
/v1/models, and a graceful shutdown on SIGINT that lets an open stream finish."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hf_accel import cli
from hf_accel.server import command

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"hf-accel serve exited with {proc.returncode}: {proc.communicate()[1][-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("hf-accel serve did not become healthy in time")


def test_serve_is_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--help"])
    assert exited.value.code == 0 and "--api-key" in capsys.readouterr().out


def test_serve_defaults(monkeypatch):
    monkeypatch.delenv(command.API_KEY_ENV, raising=False)
    args = command.build_parser().parse_args([])
    assert (args.model, args.quant, args.host, args.port, args.api_key) == (None, None, "127.0.0.1", 8000, None)
    monkeypatch.setenv(command.API_KEY_ENV, "from-env")
    assert command.build_parser().parse_args([]).api_key == "from-env"
    with pytest.raises(SystemExit):
        command.build_parser().parse_args(["--quant", "int3"])


def test_serve_command_answers_and_shuts_down_gracefully():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_accel.cli", "serve", "--port", str(port), "--api-key", "k",
                             "--quant", "int8", "--max-num-seqs", "2", "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == [command.REFERENCE_NAME]
        body = {"prompt": "def main():", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k"},
                          timeout=60) as response:
            events = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            first = next(events)
            proc.send_signal(signal.SIGINT)  # shut down while the stream is open: it still finishes
            rest = list(events)
        assert rest[-1] == "[DONE]"
        tokens = [t for event in [first, *rest[:-1]] for t in json.loads(event)["choices"][0]["token_ids"]]
        assert len(tokens) == 24
        assert proc.wait(timeout=60) == 0
        assert "Application shutdown complete" in proc.communicate()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
