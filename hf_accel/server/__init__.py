"""OpenAI-compatible HTTP server over the engine (`pip install hf_accel[serve]`): `create_app`, `serve_in_thread`,
and the `hf-accel serve` command."""

from .app import create_app
from .launch import serve_in_thread

__all__ = ["create_app", "serve_in_thread"]
