"""Shared helpers for the server tests: the reference target behind a live server on a loopback port."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.testclient import TestClient
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_accel import Engine, EngineConfig, SpeculativeConfig, reference
from hf_accel.server import command, create_app, serve_in_thread

MODEL_NAME = "reference-target"
@dataclass(slots=True)
class LiveServer:
    """A running server: its base URL (`http://127.0.0.1:port`) and the engine behind it."""

    url: str
    engine: Engine
    tokenizer: PreTrainedTokenizerBase

    @property
    def api_url(self) -> str:
        return f"{self.url}/v1"


def load_target() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The reference target and its tokenizer (which ships a chat template)."""
    model, tokenizer = reference.load("target")
    assert tokenizer.chat_template, "the reference tokenizer ships a chat template"
    return model, tokenizer


@contextlib.contextmanager
def live_server(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, api_key: str | None = None,
                max_queue_len: int = 1024, speculative: SpeculativeConfig | None = None,
                **limits) -> Iterator[LiveServer]:
    """An engine over `model` (`limits`: `EngineConfig` fields) served on 127.0.0.1 at a free port until the block
    ends (then shut down)."""
    engine = Engine(model, tokenizer, config=EngineConfig(**limits), speculative=speculative)
    app = create_app(engine, tokenizer, MODEL_NAME, api_key=api_key, max_queue_len=max_queue_len)
    with serve_in_thread(app) as url:
        yield LiveServer(url, engine, tokenizer)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids the engine computes a string prompt on (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def served_client(monkeypatch, argv: Sequence[str],
                  load_timeout: float = 600.0) -> Iterator[tuple[FastAPI, TestClient]]:
    """`hf-accel serve argv` with uvicorn's server replaced: the app it would serve, started (its engine built, as
    `/health` leaving "loading" says) until the block ends, then stopped, and the client that started it (a second
    `with TestClient(app)` would start the app, and build an engine, again)."""
    apps: list[FastAPI] = []

    class Server:  # takes the app instead of serving it
        def __init__(self, config):
            self.config, self.should_exit = config, False

        def run(self) -> None:
            apps.append(self.config.app)

    monkeypatch.setattr(command.uvicorn, "Server", Server)
    assert command.main(list(argv)) == 0
    with TestClient(apps[0]) as client:
        deadline = time.monotonic() + load_timeout
        while client.get("/health").json().get("status") == "loading":
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        assert apps[0].state.load.error is None, apps[0].state.load.error
        yield apps[0], client


@contextlib.contextmanager
def served_app(monkeypatch, argv: Sequence[str], load_timeout: float = 600.0) -> Iterator[FastAPI]:
    """`served_client`'s app."""
    with served_client(monkeypatch, argv, load_timeout) as (app, _):
        yield app
