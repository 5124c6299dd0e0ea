"""The engine's step, single-threaded: start constrained requests -> schedule -> propose -> run -> commit ->
postprocess.

- start: requests with `structured_outputs` whose grammar is compiled (`structured_requests.py`) join the queue;
- schedule: which sequences run and how many tokens each computes (`scheduler.py`), room for candidates included;
- propose: a constrained sequence's grammar-forced tokens (`spec_decode/jump_forward.py`), else the proposer's
  candidates, for the sequences given room (`spec_decode/`; without speculation the `NullProposer`, which no
  sequence is given room for);
- run: one model forward over every scheduled token (`model_runner.py`);
- commit: each sampling sequence's draw or verified candidates appended under the stop rules (`commit.py`);
- postprocess: the proposer learns what was committed, computed tokens move on and full blocks join the prefix cache
  (`Scheduler.postprocess`), finished requests leave.

`EngineCore` is driven by one thread at a time (`Engine` owns the threading); it never blocks, except that a step
with nothing to run while grammars compile waits for one of them at most `GRAMMAR_WAIT` seconds.

Fault isolation: whatever raises while handling one request (creating its samples and generators, proposing its
candidates, its logits processors and draw, its logprobs, detokenization or stop rules) fails that request alone:
its blocks go back to the pool, every sample ends with finish_reason "error", `Request.error` says why, and the
step goes on for the others. Only what concerns every request (scheduling, the model's forward) raises out of
`step`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.kv_shape import KVShape
from ..lora.config import LoRAConfig
from ..runtime.kv_pool import KVPool
from ..structured.matcher import TokenMatcher
from .block_manager import BlockManager
from .commit import Committer, eos_token_ids
from .config import EngineConfig
from .detokenizer import Detokenizer
from .engine_stats import EngineStats
from .errors import each_alone_on_error
from .limits import EngineLimits, context_length
from .lora_requests import served_adapters
from .model_runner import ModelRunner, StepOutput, uses_cuda_graphs
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from .sequence import Request, make_sequences
from .spec_decode import SpeculativeConfig, make_proposer
from .spec_decode.jump_forward import JumpForward
from .structured_requests import GrammarCompiles


logger = logging.getLogger(__name__)
# faults no single request owns: they stop the loop even when raised while handling one request
FATAL_ERRORS = (MemoryError, torch.OutOfMemoryError)
GRAMMAR_WAIT = 0.005  # seconds a step with nothing to run waits for a compiling grammar (new requests wait as long)


class EngineCore:
    """Scheduler, block manager, model runner, proposer and committer of one model."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, config: EngineConfig,
                 speculative: SpeculativeConfig | None = None, lora: LoRAConfig | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = config.max_model_len or context_length(model)
        candidates = 0 if speculative is None else speculative.num_candidates
        self.adapters = None if lora is None else served_adapters(
            model, lora, speculative, compile=not config.enforce_eager,
            max_step_tokens=config.max_num_batched_tokens + config.max_num_seqs * (1 + candidates))
        # LoRA steps compile where the hooks can be in the graphs (`EngineAdapters.compiled`), else run eagerly
        eager = config.enforce_eager or (self.adapters is not None and not self.adapters.compiled)
        self.proposer = make_proposer(speculative, model)
        self.candidates = JumpForward(self.proposer, config.structured_jump_forward)  # forced tokens first
        shape = KVShape.from_config(model.config, caller="the engine", argument="model")
        dtype, device = model.dtype, next(model.parameters()).device
        bytes_per_token = shape.bytes_per_token(dtype) + self.proposer.kv_bytes_per_token(dtype)  # its pool's too
        num_blocks = config.num_blocks(bytes_per_token, self.max_model_len)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(speculative), self.blocks, self.candidates.room,
                                   self.adapters)
        keep_hidden = self.proposer.needs_hidden
        # a proposer with a pool of its own (EAGLE, draft model) compiles its graphs at start: so does the step
        background = config.compile_in_background and not eager and not self.proposer.kv_bytes_per_token(dtype)
        self.kv = KVPool(shape, num_blocks, config.block_size, dtype, device,
                         spare_block=background or uses_cuda_graphs(device, eager, keep_hidden))
        self.runner = ModelRunner(model, self.kv, keep_hidden=keep_hidden, enforce_eager=eager,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  feature_layers=self.proposer.feature_layers, compile_in_background=background,
                                  graph_inputs=None if self.adapters is None else self.adapters.graph_inputs)
        # an EAGLE head's or a draft model's pool, beside the target's (nothing for the other proposers)
        self.proposer.allocate(num_blocks, config.block_size, dtype, device, self.runner.attend,
                               compile=self.runner.forward.compiled)
        eos = eos_token_ids(model, tokenizer)
        self.committer = Committer(eos, self.max_model_len, self.fail)
        self.requests: dict[str, Request] = {}
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.grammars = GrammarCompiles(tokenizer, self.vocab_size, sorted(eos))
        self.prompt_tokens = self.num_steps = self.num_failed_requests = 0
        self._failed: list[Request] = []  # failed since the last step returned, still to be reported

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling at start: the model step's graphs, and an EAGLE head's or a draft model's."""
        return self.runner.forward.compile_seconds + self.proposer.compile_seconds

    @property
    def compiling(self) -> bool:
        """Whether the model step's graphs are compiling in the background (`compile_in_background`)."""
        return self.runner.forward.compiling

    @property
    def has_unfinished(self) -> bool:
        """Whether a step has work: sequences to run, grammars compiling, or failed requests not reported yet."""
        return self.scheduler.has_unfinished or self.grammars.has_pending or bool(self._failed)

    @property
    def limits(self) -> EngineLimits:
        """This engine's vocabulary, context, `max_num_seqs` and KV cache size, which requests are checked against."""
        return EngineLimits(self.vocab_size, self.max_model_len, self.config.max_num_seqs,
                            self.blocks.num_blocks * self.blocks.block_size)

    def add(self, request: Request) -> None:
        """Queue a checked request (its ids unique among unfinished requests; one with `structured_outputs` waits
        for its grammar first); if creating its samples raises, the request fails alone and the next step reports
        it."""
        self.requests[request.request_id] = request
        try:
            make_sequences(request, self._detokenizer_for)
            if self.adapters is not None:
                self.adapters.hold(request)
        except Exception as error:  # e.g. its generator's seed, its adapter's folder: this request's own fault
            self.fail(request, error)
            return
        self.prompt_tokens += len(request.prompt_token_ids)
        if request.params.structured_outputs is not None:
            compiled = self.grammars.compiled(request)
            if compiled is None:
                self.grammars.submit(request)
            else:  # compiled for an earlier request: it starts now
                self._start(request, compiled)
            return
        for seq in request.sequences:
            self.scheduler.add(seq)

    def fail(self, request: Request, error: BaseException) -> None:
        """End `request` alone on `error`: free its blocks, finish its samples with "error"; the next step returns
        it. No-op for a request already finished; `FATAL_ERRORS` are raised again instead."""
        if isinstance(error, FATAL_ERRORS):
            raise error
        if request.request_id not in self.requests:
            return
        self.grammars.cancel(request)
        logger.warning("request %s failed: %s: %s", request.request_id, type(error).__name__, error,
                       exc_info=(type(error), error, error.__traceback__))
        for seq in request.sequences:  # finished ones too: one may have finished in the step that failed
            self.scheduler.remove(seq)
        request.fail(error)
        self._retire(request)
        self.num_failed_requests += 1
        self._failed.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request now, freeing its blocks; None if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.grammars.cancel(request)
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish("abort")
        self._retire(request)
        return request

    def step(self) -> list[Request]:
        """Run one step; returns the requests whose output changed, failed ones included (finished ones are
        forgotten)."""
        self._start_constrained()
        batch = self.scheduler.schedule()
        self._mark_scheduled(batch, time.perf_counter())
        self._propose(batch)
        if not batch.scheduled:  # nothing to run, or every speculating sequence's proposer failed
            if not batch.preempted and not self._failed:  # only grammars compiling: wait for one, briefly
                self.grammars.wait(GRAMMAR_WAIT)
            return self._take_failed()
        started = time.perf_counter()
        with contextlib.nullcontext() if self.adapters is None else self.adapters.running(batch):
            out = self.runner.execute(batch)
        now = time.perf_counter()
        num_accepted = self.committer.commit(out, now)
        changed = self._postprocess(batch, out, num_accepted, now - started)
        failed = self._take_failed()
        return failed + [request for request in changed if request.error is None]

    def stats(self) -> EngineStats:
        running = {seq.request.request_id: seq.request for seq in self.scheduler.running}
        waiting = {seq.request.request_id: seq.request for seq in self.scheduler.waiting
                   if seq.request.request_id not in running}
        spec = self.committer.spec_decode
        return EngineStats(
            len(running), len(waiting), self.blocks.usage, self.scheduler.num_preemptions,
            self.blocks.stats.queries, self.blocks.stats.hits, self.prompt_tokens, self.committer.generation_tokens,
            self.num_steps, self.blocks.num_free_blocks, self.blocks.num_blocks, spec.num_drafts,
            spec.num_draft_tokens, spec.num_accepted_tokens, self.compile_seconds,
            list(spec.accepted_per_position), self.compiling, self.candidates.num_forced_tokens,
            0 if self.adapters is None else self.adapters.config.max_loras,
            adapter_counts(running.values()), adapter_counts(waiting.values()),
        )

    def _start_constrained(self) -> None:
        """Requests whose grammar compiled join the queue, each sample with its own matcher; those whose compile
        failed fail alone."""
        for request, compiled in self.grammars.take_ready():
            if isinstance(compiled, BaseException):
                self.fail(request, compiled)
            else:
                self._start(request, compiled)

    def _start(self, request: Request, compiled: Any) -> None:
        """Queue a constrained request's samples, each with its own matcher over `compiled`."""
        try:
            spelling = self.grammars.spelling(request, compiled)
            for seq in request.sequences:
                seq.grammar = TokenMatcher(compiled, spelling)
        except Exception as error:
            self.fail(request, error)
            return
        for seq in request.sequences:
            self.scheduler.add(seq)

    def _mark_scheduled(self, batch: ScheduledBatch, now: float) -> None:
        """A request scheduled for the first time: its queue time ends, its prefix-cache hits (every sample's) count
        as cached."""
        starting = {id(seq.request) for seq in batch.seqs if seq.request.timing.first_scheduled is None}
        for seq in batch.seqs:
            if id(seq.request) in starting:
                seq.request.timing.first_scheduled = now
                seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, seq.num_computed_tokens)

    def _propose(self, batch: ScheduledBatch) -> None:
        """Fill the candidates of the sequences the scheduler gave room for some. When the batched proposal raises,
        each sequence is proposed for alone, and those that still raise fail (and leave the batch)."""
        speculating = [s for s in batch.scheduled if s.num_drafts]
        if not speculating:
            return

        def failed(scheduled: ScheduledSeq, error: Exception) -> None:
            for sibling in scheduled.seq.request.sequences:
                batch.drop(sibling)
            self.fail(scheduled.seq.request, error)

        each_alone_on_error(self._propose_for, speculating, failed)

    def _propose_for(self, speculating: list[ScheduledSeq]) -> None:
        proposals = self.candidates.propose([s.seq for s in speculating], [s.num_drafts for s in speculating])
        for scheduled, proposal in zip(speculating, proposals):
            scheduled.keep_drafts(proposal)

    def _postprocess(self, batch: ScheduledBatch, out: StepOutput, num_accepted: dict[int, int],
                     seconds: float) -> list[Request]:
        """After the commit: the proposer learns what was committed (features, if the step returned them, each
        sequence alone on error), computed tokens move on, finished requests leave; returns the requests the step
        changed."""
        if out.features is not None:
            committed = out.committed_features(batch.scheduled, num_accepted)
            each_alone_on_error(self.proposer.take_features, committed,
                                lambda one, error: self.fail(one[0].request, error))
        self.proposer.observe_step(batch, out, num_accepted, seconds)
        self.scheduler.postprocess(batch, num_accepted)
        self.num_steps += 1
        changed = {s.seq.request.request_id: s.seq.request for s in out.sampling}
        for request in changed.values():
            if request.is_finished and request.error is None:
                self._retire(request)
        return list(changed.values())

    def _retire(self, request: Request) -> None:
        """A finished request (done, aborted or failed) leaves: its end time, and no state kept for its samples."""
        request.timing.finished = time.perf_counter()
        del self.requests[request.request_id]
        if self.adapters is not None:
            self.adapters.forget(request)
        for seq in request.sequences:
            self.proposer.forget(seq)

    def _take_failed(self) -> list[Request]:
        failed, self._failed = self._failed, []
        return failed

    def _detokenizer_for(self, params: SamplingParams) -> Detokenizer | None:
        return None if self.tokenizer is None else Detokenizer(self.tokenizer, params.stop)


def adapter_counts(requests: Iterable[Request]) -> dict[str, int]:
    """Adapter name -> how many of `requests` run with it (base requests not counted)."""
    return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None))
