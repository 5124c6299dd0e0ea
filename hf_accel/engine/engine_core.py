"""The engine's step, single-threaded: schedule, propose candidates (`speculation.py`), run the model once, sample or
verify, detect stops, free finished blocks.

`EngineCore` is driven by one thread at a time (`Engine` owns the threading); it never blocks and never sleeps.

Fault isolation: whatever raises while handling one request (creating its samples and generators, proposing its
candidates, its logits processors and draw, its logprobs, detokenization or stop rules) fails that request alone:
its blocks go back to the pool, every sample ends with finish_reason "error", `Request.error` says why, and the
step goes on for the others. Only what concerns every request (scheduling, the model's forward) raises out of
`step`.
"""

from __future__ import annotations

import logging
import time
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.kv_shape import KVShape
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import Detokenizer
from .engine_stats import EngineStats
from .errors import each_alone_on_error
from ..runtime.kv_pool import KVPool
from .limits import EngineLimits, context_length
from .model_runner import ModelRunner, StepOutput, uses_cuda_graphs
from .proposer import Proposer, SpecDecodeStats, make_proposer
from .sampling_params import SamplingParams
from .sampler import sample, token_logprobs
from .scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from .sequence import Request, Sequence, make_sequences
from .speculation import Speculation
from .speculative_config import SpeculativeConfig


logger = logging.getLogger(__name__)
# faults no single request owns: they stop the loop even when raised while handling one request
FATAL_ERRORS = (MemoryError, torch.OutOfMemoryError)


class EngineCore:
    """Scheduler, block manager, model runner, sampler and (with `speculative`) proposer of one model."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, config: EngineConfig,
                 speculative: SpeculativeConfig | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = config.max_model_len or context_length(model)
        if speculative is not None and speculative.method in ("medusa", "eagle3"):
            speculative.model.check_compatible(model)
        self.speculation = None if speculative is None else Speculation(make_proposer(speculative, model))
        shape = KVShape.from_config(model.config, caller="the engine", argument="model")
        dtype, device = model.dtype, next(model.parameters()).device
        pool_proposer = self.proposer is not None and self.proposer.has_pool
        proposer_bytes = self.proposer.kv_bytes_per_token(dtype) if pool_proposer else 0  # a head's or draft's K/V
        num_blocks = config.num_blocks(shape.bytes_per_token(dtype) + proposer_bytes, self.max_model_len)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(speculative), self.blocks,
                                   *([] if self.proposer is None else [self.proposer.can_propose]))
        keep_hidden = self.proposer is not None and self.proposer.needs_hidden
        self.kv = KVPool(shape, num_blocks, config.block_size, dtype, device,
                         spare_block=uses_cuda_graphs(device, config.enforce_eager, keep_hidden))
        self.runner = ModelRunner(model, self.kv, keep_hidden=keep_hidden, enforce_eager=config.enforce_eager,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  feature_layers=() if self.proposer is None else self.proposer.feature_layers)
        if pool_proposer:  # the EAGLE head's or the draft model's pool, beside the target's
            self.proposer.allocate(num_blocks, config.block_size, dtype, device, self.runner.attend,
                                   compile=self.runner.forward.compiled)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.prompt_tokens = self.generation_tokens = self.num_steps = self.num_failed_requests = 0
        self._failed: list[Request] = []  # failed since the last step returned, still to be reported

    @property
    def proposer(self) -> Proposer | None:
        """The speculative method's `Proposer`, or None without speculation."""
        return None if self.speculation is None else self.speculation.proposer

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling at start: the model step's graphs, and an EAGLE head's or a draft model's."""
        proposer = self.proposer.compile_seconds if self.proposer is not None and self.proposer.has_pool else 0.0
        return self.runner.forward.compile_seconds + proposer

    @property
    def has_unfinished(self) -> bool:
        """Whether a step has work: sequences to run, or failed requests not reported yet."""
        return self.scheduler.has_unfinished or bool(self._failed)

    @property
    def limits(self) -> EngineLimits:
        """This engine's vocabulary, context, `max_num_seqs` and KV cache size, which requests are checked against."""
        return EngineLimits(self.vocab_size, self.max_model_len, self.config.max_num_seqs,
                            self.blocks.num_blocks * self.blocks.block_size)

    def add(self, request: Request) -> None:
        """Queue a checked request (its ids unique among unfinished requests); if creating its samples raises, the
        request fails alone and the next step reports it."""
        self.requests[request.request_id] = request
        try:
            make_sequences(request, self._detokenizer_for)
        except Exception as error:  # e.g. its generator's seed: this request's own fault
            self.fail(request, error)
            return
        self.prompt_tokens += len(request.prompt_token_ids)
        for seq in request.sequences:
            self.scheduler.add(seq)

    def fail(self, request: Request, error: BaseException) -> None:
        """End `request` alone on `error`: free its blocks, finish its samples with "error"; the next step returns
        it. No-op for a request already finished; `FATAL_ERRORS` are raised again instead."""
        if isinstance(error, FATAL_ERRORS):
            raise error
        if request.request_id not in self.requests:
            return
        logger.warning("request %s failed: %s: %s", request.request_id, type(error).__name__, error,
                       exc_info=(type(error), error, error.__traceback__))
        for seq in request.sequences:
            if not seq.is_finished:
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
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish("abort")
        self._retire(request)
        return request

    def step(self) -> list[Request]:
        """Run one step; returns the requests whose output changed, failed ones included (finished ones are
        forgotten)."""
        batch = self.scheduler.schedule()
        self._mark_scheduled(batch, time.perf_counter())
        self._propose(batch)
        if not batch.scheduled:  # nothing to run, or every speculating sequence's proposer failed
            return self._take_failed()
        started = time.perf_counter()
        out = self.runner.execute(batch)
        now = time.perf_counter()
        num_accepted = self._commit(out, now)
        if out.features is not None:
            self._take_features(batch, out, num_accepted)
        if self.proposer is not None:
            self.proposer.observe_step(batch, num_accepted, now - started)
        self.scheduler.postprocess(batch, num_accepted)
        self.num_steps += 1
        changed = {s.seq.request.request_id: s.seq.request for s in out.sampling}
        for request in changed.values():
            if request.is_finished and request.error is None:
                self._retire(request)
        failed = self._take_failed()
        return failed + [request for request in changed.values() if request.error is None]

    def _retire(self, request: Request) -> None:
        """A finished request (done, aborted or failed) leaves: its end time, and no state kept for its samples."""
        request.timing.finished = time.perf_counter()
        del self.requests[request.request_id]
        if self.proposer is not None:
            for seq in request.sequences:
                self.proposer.forget(seq)

    def _mark_scheduled(self, batch: ScheduledBatch, now: float) -> None:
        """A request scheduled for the first time: its queue time ends, its prefix-cache hits (every sample's) count
        as cached."""
        starting = {id(seq.request) for seq in batch.seqs if seq.request.timing.first_scheduled is None}
        for seq in batch.seqs:
            if id(seq.request) in starting:
                seq.request.timing.first_scheduled = now
                seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, seq.num_computed_tokens)

    def stats(self) -> EngineStats:
        running = {seq.request.request_id for seq in self.scheduler.running}
        spec = SpecDecodeStats() if self.speculation is None else self.speculation.stats
        waiting = {seq.request.request_id for seq in self.scheduler.waiting} - running
        return EngineStats(
            len(running), len(waiting), self.blocks.usage, self.scheduler.num_preemptions,
            self.blocks.stats.queries, self.blocks.stats.hits, self.prompt_tokens, self.generation_tokens,
            self.num_steps, self.blocks.num_free_blocks, self.blocks.num_blocks, spec.num_drafts,
            spec.num_draft_tokens, spec.num_accepted_tokens, self.compile_seconds,
            list(spec.accepted_per_position),
        )

    def _propose(self, batch: ScheduledBatch) -> None:
        """Fill `draft_token_ids` of the sequences the scheduler lets speculate this step. When the batched
        proposal raises, each sequence is proposed for alone, and those that still raise fail (and leave the batch)."""
        speculating = [s for s in batch.scheduled if s.num_drafts]
        if not speculating:
            return

        def failed(scheduled: ScheduledSeq, error: Exception) -> None:
            for sibling in scheduled.seq.request.sequences:
                batch.drop(sibling)
            self.fail(scheduled.seq.request, error)

        each_alone_on_error(self.speculation.propose, speculating, failed)

    def _commit(self, out: StepOutput, now: float) -> dict[int, int]:
        """Append each sampling sequence's new tokens (sampled, or verified candidates) and tell the proposer;
        returns the candidates each speculating sequence kept, by `seq_id`. A sequence whose handling raises fails
        its request alone."""
        emitted = self._verify(out)
        plain = [i for i, s in enumerate(out.sampling) if not s.num_drafts]
        if plain:
            sampled = sample(out.logits[[out.starts[i] for i in plain]], [out.sampling[i].seq for i in plain])
            for row, i in enumerate(plain):
                if row in sampled.errors:  # its sampling settings could not be applied to these logits
                    self.fail(out.sampling[i].seq.request, sampled.errors[row])
                else:
                    emitted[i] = [sampled.tokens[row]]
        num_accepted = {}
        for i, scheduled in enumerate(out.sampling):
            if scheduled.seq.is_finished:  # its request failed earlier in this step
                continue
            try:
                num_accepted[scheduled.seq.seq_id] = self._commit_one(out, i, emitted[i], now)
            except Exception as error:
                self.fail(scheduled.seq.request, error)
        return num_accepted

    def _verify(self, out: StepOutput) -> dict[int, list[int]]:
        """The tokens each speculating sampling sequence emits (`Speculation.verify`); those whose verification
        raised fail alone."""
        speculating = [i for i, s in enumerate(out.sampling) if s.num_drafts]
        if not speculating:
            return {}
        emitted, errors = self.speculation.verify(out, speculating)
        for i, error in errors.items():
            self.fail(out.sampling[i].seq.request, error)
        return emitted

    def _commit_one(self, out: StepOutput, i: int, tokens: list[int], now: float) -> int:
        """Sampling sequence `i`'s part of `_commit`: append `tokens` (its draw, or its verified candidates and the
        target's token) under every stop rule. Returns the candidates it kept."""
        seq, rows = out.sampling[i].seq, out.rows(i)
        logprobs = token_logprobs(out.logits[rows][: len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
        num_appended = self._append_all(seq, tokens, logprobs, now)
        if not seq.is_finished and self.proposer is not None:
            self.proposer.observe(seq, None if out.hidden is None else out.hidden[rows.start + num_appended - 1])
        return min(len(tokens) - 1, num_appended)  # K/V is valid for the last token and the kept candidates

    def _take_features(self, batch: ScheduledBatch, out: StepOutput, num_accepted: dict[int, int]) -> None:
        """Hand the proposer the features this step commits (if that raises: each sequence alone, failing its own)."""
        committed = out.committed_features(batch.scheduled, num_accepted)
        each_alone_on_error(self.proposer.take_features, committed,
                            lambda one, error: self.fail(one[0].request, error))

    def _take_failed(self) -> list[Request]:
        failed, self._failed = self._failed, []
        return failed

    def _append_all(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> int:
        """Append `tokens` one at a time until a stop rule ends the sequence; returns how many were appended."""
        for n, (token, logprob) in enumerate(zip(tokens, logprobs), start=1):
            self._append(seq, token, logprob, now)
            if seq.is_finished:
                return n
        return len(tokens)

    def _append(self, seq: Sequence, token: int, logprob, now: float) -> None:
        request = seq.request
        if request.timing.first_token is None:
            request.timing.first_token = now
        request.timing.last_token = now
        self.generation_tokens += 1
        stop_string = seq.append_token(token, logprob, now)
        params = seq.params
        if stop_string is not None:
            seq.finish("stop", stop_string)
        elif token in params.stop_token_ids:
            seq.finish("stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            seq.finish("stop")
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")

    def _detokenizer_for(self, params: SamplingParams) -> Detokenizer | None:
        return None if self.tokenizer is None else Detokenizer(self.tokenizer, params.stop)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)

