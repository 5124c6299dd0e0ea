"""Shared helpers for the server tests: the reference target behind a live server on a loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_accel import Engine, reference
from hf_accel.server import create_app, serve_in_thread

MODEL_NAME = "reference-target"
# until the reference tokenizer ships its template
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(slots=True)
class LiveServer:
    """A running server: its base URL (`http://127.0.0.1:port`) and the engine behind it."""

    url: str
    engine: Engine
    tokenizer: PreTrainedTokenizerBase

    @property
    def api_url(self) -> str:
        return f"{self.url}/v1"


def load_target(chat_template: bool = True) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The reference target and tokenizer; with `chat_template`, a simple template if the tokenizer has none."""
    model, tokenizer = reference.load("target")
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE  # until the reference tokenizer ships its template
    return model, tokenizer


@contextlib.contextmanager
def live_server(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, api_key: str | None = None,
                max_queue_len: int = 1024, **engine_kwargs) -> Iterator[LiveServer]:
    """An engine over `model` served on 127.0.0.1 at a free port until the block ends (then shut down)."""
    engine = Engine(model, tokenizer, **engine_kwargs)
    app = create_app(engine, tokenizer, MODEL_NAME, api_key=api_key, max_queue_len=max_queue_len)
    with serve_in_thread(app) as url:
        yield LiveServer(url, engine, tokenizer)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids the engine computes a string prompt on (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
