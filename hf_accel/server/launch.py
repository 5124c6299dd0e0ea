"""`serve_in_thread`: run an app with uvicorn in a background thread on a loopback port (tests, benchmarks).

    with serve_in_thread(create_app(engine, tokenizer, "my-model")) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0,
                    log_level: str = "warning") -> Iterator[str]:
    """Serve `app` on `host:port` (port 0: a free one) until the block ends; yields the base URL
    (`http://host:port`). On exit the server stops (open streams are closed, the app's shutdown runs) and the
    thread is joined. Raises RuntimeError if the server does not start within `startup_timeout` seconds."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hf_accel-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(startup_timeout)
        sock.close()
