"""Shared helpers for the server tests: the reference target behind a live server on a loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_accel import Engine, EngineConfig, SpeculativeConfig, reference
from hf_accel.server import create_app, serve_in_thread

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
