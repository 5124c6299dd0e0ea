"""`Engine`: continuous batching for any decoder-only transformers model, with vLLM-like names.

    engine = hf_accel.Engine(model, tokenizer, config=hf_accel.EngineConfig(max_num_seqs=32))
    outputs = engine.generate(["def add(a, b):", "import os"], hf_accel.SamplingParams(max_tokens=64, temperature=0))
    async for out in engine.stream("class Stack:", params): print(out.text)

Threads: the core (scheduler, blocks, model) is driven by one thread at a time. `generate` drives it in the calling
thread, unless the background loop is running (`start`, or the first `stream`), which then owns it (and the model:
while it steps, and while its graphs compile in the background, the model's attention implementation is the
engine's, so do not call `model.generate` from another thread then); requests and aborts from other threads go
through a queue the stepping thread drains before each step, so callers never wait for a model forward.

Faults: what one request's handling raises fails that request alone (its output ends with finish_reason "error" and
`RequestOutput.error`; see `engine_core`); a listener that raises has its request aborted. Only a fault that
concerns every request (the model's forward raising, out of memory) stops the loop: it is logged once at ERROR with
its traceback, `is_healthy` turns False (`dead_reason` says why), every open request gets `EngineDeadError`, and no
new request is accepted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..display import RichDisplay, format_bytes
from ..lora.config import LoRAConfig, check_lora_id
from .admission import Admission
from .config import EngineConfig
from .deprecated_keywords import engine_configs
from .engine_client import EngineClient
from .engine_core import EngineCore, EngineStats
from .errors import EngineDeadError, describe
from .listeners import Listener, Listeners
from .outputs import RequestOutput, RequestOutputKind
from .sequence import Request
from .spec_decode.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


class Engine(RichDisplay, EngineClient):
    """Continuous-batching generation over a paged KV block pool.

    Args:
        model: a decoder-only causal LM whose attention goes through transformers' `AttentionInterface` (Llama,
            Mistral, Qwen2/3, Gemma2/3, Phi3, ...), in any dtype; hf_accel int8/int4 weights work as they are.
        tokenizer: turns string prompts into ids and outputs into text (optional with token-id prompts).
        config: the engine's limits, an `EngineConfig` (default: `EngineConfig()`).
        speculative: a `SpeculativeConfig`: decoding sequences verify candidates ("ngram", "suffix", "medusa",
            "eagle3", "draft") while the decoding batch is small; greedy outputs are plain greedy's, sampling stays
            lossless (docs/serving.md, "Speculative decoding").
        lora: a `LoRAConfig`: serve peft LoRA adapters unmerged, chosen per request
            (`add_request(..., lora_request=hf_accel.LoRARequest(name, id, path))`, `generate(..., lora_request=)`),
            requests of several adapters and of the base batched in one step (docs/lora.md). Its steps run eagerly,
            and it works with the "ngram" and "suffix" speculative methods.

    The keywords of the release before (`max_num_seqs=...` and the other `EngineConfig` fields, `medusa_heads=` with
    `num_speculative_tokens` and `max_speculative_batch_tokens`) still work, with a DeprecationWarning that says what
    to write instead; they are removed in the next release.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 config: EngineConfig | None = None, speculative: SpeculativeConfig | None = None,
                 lora: LoRAConfig | None = None, **deprecated_keywords: Any):
        self.config, self.speculative = engine_configs(config, speculative, deprecated_keywords)
        self.tokenizer = tokenizer
        self.core = EngineCore(model, tokenizer, self.config, self.speculative, lora)
        self.limits = self.core.limits
        self._admission = Admission(tokenizer, self.limits, self.core.adapters)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._listeners = Listeners()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._drive_lock = threading.Lock()  # held by whichever thread steps the core

    @property
    def is_running(self) -> bool:
        """Whether the background loop is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """What stopped the loop (`"<error type>: <message>"`), or None while it is healthy."""
        return None if self._dead is None else describe(self._dead)

    def submit(self, request: Request, listener: Listener | None = None) -> None:
        """Queue a request already checked by an `Admission` against this engine's limits (thread-safe); the
        engine-core process receives its requests this way. ValueError when its id is in use."""
        self._check_alive()
        self._register(request, listener)
        self._inbox.put(lambda: self.core.add(request))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the start of the next step (thread-safe; unknown ids ignored)."""
        self._inbox.put(lambda: self._deliver_abort(request_id))
        self._wakeup.set()

    def remove_lora(self, lora_int_id: int) -> None:
        """As `EngineClient.remove_lora`, at the start of the next step (thread-safe)."""
        check_lora_id(lora_int_id, self.core.adapters)
        self._inbox.put(lambda: self.core.adapters.remove(lora_int_id))
        self._wakeup.set()

    def step(self) -> list[RequestOutput]:
        """Run one step in the calling thread (not while the background loop runs); returns the changed requests."""
        if self.is_running:
            raise RuntimeError("the background loop is running; use generate/stream instead of step")
        with self._drive_lock:
            return self._step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished or not self._inbox.empty()

    def _run_until(self, done: threading.Event) -> None:
        """Wait for the background loop to set `done`, or step in this thread until it is set."""
        if self.is_running:
            done.wait()
            return
        with self._drive_lock, self.core.runner.forward.stepping():  # switched once per call
            while not done.is_set():
                self._step()
                if not done.is_set() and not self.has_unfinished_requests():
                    raise RuntimeError("the engine has no work left but requests did not finish")

    def stats(self) -> EngineStats:
        return self.core.stats()

    def summary(self) -> dict[str, object]:
        """What the engine shows in a repr / Jupyter table: model, limits, pool, queues and counters."""
        stats, config = self.stats(), self.config
        return {
            "model": type(self.core.model).__name__, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "max_model_len": self.max_model_len,
            "blocks": f"{stats.num_blocks - stats.num_free_blocks}/{stats.num_blocks} x {config.block_size} tokens",
            "kv_memory": format_bytes(self.core.kv.nbytes), "running": stats.num_requests_running,
            "waiting": stats.num_requests_waiting, "steps": stats.num_steps,
            "generated_tokens": stats.generation_tokens, "preemptions": stats.num_preemptions,
            "prefix_hit_rate": self.core.blocks.stats.hit_rate, "loop": self._loop_state(),
        }

    def _loop_state(self) -> str:
        return "dead" if self._dead is not None else "running" if self.is_running else "stopped"

    def start(self) -> None:
        """Start the background loop (idempotent)."""
        self._check_alive()
        if self.is_running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="hf_accel-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the background loop after its current step; unfinished requests are aborted. A background compile
        (`EngineConfig.compile_in_background`) stops at its next graph: the engine stays eager if started again."""
        self.core.runner.forward.cancel_compile()
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._drive_lock:
            self._drain_inbox()
            for request_id in list(self.core.requests):
                self._deliver_abort(request_id)
            self.core.grammars.shutdown()

    def _loop(self) -> None:
        with self._drive_lock:
            while not self._stopping:
                if not self.has_unfinished_requests():
                    self._drive_lock.release()
                    try:
                        self._wakeup.wait(0.5)
                        self._wakeup.clear()
                    finally:
                        self._drive_lock.acquire()
                    continue
                try:
                    # switched once per busy spell, restored when idle
                    with self.core.runner.forward.stepping():
                        while not self._stopping and self.has_unfinished_requests():
                            self._step()
                except BaseException as error:  # the loop is dead: tell every waiting request, refuse new ones
                    logger.error("the engine loop stopped; every request fails from now on", exc_info=error)
                    self._dead = error
                    self._listeners.fail_all(error)
                    return

    def _step(self) -> list[RequestOutput]:
        self._drain_inbox()
        reports = [self._deliver(request) for request in self.core.step()]
        return [report for report in reports if report is not None]

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, request: Request) -> RequestOutput | None:
        """Hand the request's report (by its output kind) to its listener and, once finished, its whole output to
        the finish observers; returns the report."""
        report = request.report()
        if report is not None and not self._listeners.deliver(report) and not report.finished:
            self.abort(request.request_id)
        if request.is_finished and self._listeners.has_finish_observers:
            whole = report if request.output_kind is not RequestOutputKind.DELTA else request.snapshot()
            self._listeners.observe_finished(whole)
        return report

    def _deliver_abort(self, request_id: str) -> None:
        request = self.core.abort(request_id)
        if request is not None:
            self._deliver(request)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine loop died; create a new Engine") from self._dead

