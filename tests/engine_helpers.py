"""Shared helpers for the engine tests: reference outputs from plain `generate`, one request at a time, and an
engine whose steps the test holds (`HeldSteps`)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from conformance import FIRST_WORD, VOCAB_SIZE
from hf_accel import Engine


def random_prompts(lengths: list[int], seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    """Token-id prompts of the given lengths over the tiny vocabulary's word ids."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_WORD, vocab_size) for _ in range(n)] for n in lengths]


def greedy_reference(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate` greedy continuation of one unpadded prompt (no early stop), new tokens only."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def top2_gap(model: PreTrainedModel, tokens: list[int]) -> float:
    """Gap between the two best next-token logits after `tokens` (plain forward, no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_equal(model: PreTrainedModel, prompt: list[int], got: list[int], expected: list[int],
                        tie_atol: float = 1e-4) -> None:
    """Tokens equal, or first differ only at a near tie of the reference's two best logits (batched matmuls round
    differently from one-row ones; a tie within `tie_atol` may flip either way)."""
    if got == expected:
        return
    step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b) if len(got) == len(expected) else None
    assert step is not None, f"lengths differ: {len(got)} vs {len(expected)}"
    gap = top2_gap(model, prompt + expected[:step])
    assert gap <= tie_atol, f"first difference at step {step} with a top-2 logit gap of {gap:.2e}: {got} vs {expected}"


class HeldSteps:
    """The engine's steps, held by the test (the tiny reference runs a whole request in well under a second, faster
    than a test can act on it): while held, each step waits before its forward for a step the test `allow`s, until
    `release`. It wraps the model runner's `execute`, which eager and compiled steps both go through."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch, held: bool = True) -> None:
        self._held, self._permits, self._parked = held, threading.Semaphore(0), threading.Event()
        self.num_waits = 0  # steps that waited for a permit
        real_execute = engine.core.runner.execute

        def held_execute(batch):
            if self._held:
                self.num_waits += 1
                self._parked.set()
                assert self._permits.acquire(timeout=60), "the test never let the engine step on"
            return real_execute(batch)

        monkeypatch.setattr(engine.core.runner, "execute", held_execute)

    def hold(self, timeout: float = 10.0) -> None:
        """Hold the steps (running freely until now) from the next one on; returns once the engine waits (a request
        must be running). Permits left from before are dropped."""
        while self._permits.acquire(blocking=False):
            pass
        self._parked.clear()
        self._held = True
        assert self._parked.wait(timeout), "no engine step came to hold"

    def allow(self, steps: int = 1) -> None:
        """Let `steps` more steps run (now or as they come)."""
        self._permits.release(steps)

    def step_until(self, condition: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Allow one step at a time (a pause between) until `condition()` holds; False after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            self.allow()
            time.sleep(0.02)
        return True

    def release(self) -> None:
        """Steps run freely from now on (the one waiting, if any, goes on)."""
        assert self.num_waits, "no engine step was held: the test did not test what it says"
        self._held = False
        self._permits.release()
