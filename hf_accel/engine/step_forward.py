"""The model forward of one engine step, eager or compiled once per engine with `torch.compile`.

Compiled (the default where the in-place kernel is built; `enforce_eager=True` turns it off, vLLM's name), the
model's own forward runs through inductor with dynamic shapes: the packed token count, the number of sequences, the
block table's width and the kept rows may change every step without recompiling. The attention is one opaque custom
op (`torch.ops.hf_accel.paged_attention`, mutating the pools in place), so the graph is whole (`fullgraph=True`).
Two rules keep it to two graphs (one token, several tokens): sizes are never duck-shaped into one symbol because they
happen to be equal when traced, and the sizes that can be 1 (sequences, block-table width, kept rows), which torch
would specialize, are padded to at least 2 (an empty sequence, a column of block 0, the last kept row repeated: none
changes a result). A step of one sequence decoding one token (the latency-bound case: one request streaming) runs
a third graph with static shapes instead (`max_blocks` given: its block table padded to the engine's widest), the
way vLLM captures fixed sizes: no symbolic sizes to compute or guard on. All graphs are traced and compiled in
`warm_up`, at engine start, so `compile_seconds` is the whole cost and no request waits for a compile; inductor's
on-disk cache of built C++ kernels makes a restart cheaper (its FX graph cache is skipped for fp32 graphs with packed
Linears: `packed_linears.settings`).
In the engine-core process (`EngineProcess`), steps (and an EAGLE head's passes) after the warm-up skip dynamo's
guards (`skip_guard_eval_unsafe`: only the guards that tell the graphs apart run; `warm_guards`), since every step's
inputs differ from the warmed ones in sizes and values only; the full guards cost about 0.5 ms a step, a tenth of a
one-sequence decode on the reference target.
Only there: dynamo's stance is process-wide, and beside an in-process engine other threads may run compiled code
whose guards must run (`skip_warm_guards`).
The weights are frozen into the graphs (inductor's `freezing`), so each Linear runs over a weight packed once (fp32:
hf_accel's kernel over column panels, `packed_linears.py`; else oneDNN's matmul); the graphs are kept per model and
its weights (`frozen_graphs.py`), so engines on the same unchanged model share them and a model whose weights changed
gets new ones.
On a GPU, decode steps replay CUDA graphs instead (`cuda_graphs.py`), captured in the same warm-up.
With `feature_layers` (an EAGLE head's inputs) the step also returns those hidden states at every packed token,
compiled too: transformers installs its hidden-state capturing hooks on the first call, behind a lock dynamo cannot
trace, so one eager call installs them before the graphs are traced.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as symbolic_config
from transformers import PreTrainedModel

from .attention import ATTENTION_NAME, StepAttention
from .cuda_graphs import DecodeGraphs
from .frozen_graphs import compiled_for, freezing
from .kv_pool import KVPool, token_slots


RECOMPILE_LIMIT = 256  # graphs of one model class in one process (two per compiled engine)
# graphs of every function in one process: dynamo's default (256) is reached by a long notebook or test session, after
# which it compiles nothing more (an engine would run eagerly, compiled generate would raise)
ACCUMULATED_RECOMPILE_LIMIT = 8192


_SKIP_WARM_GUARDS = False


def skip_warm_guards(enabled: bool) -> None:
    """Let warm engine steps skip dynamo's guards in this process: for a process where only the engine's thread runs
    compiled code (the engine-core process)."""
    global _SKIP_WARM_GUARDS
    _SKIP_WARM_GUARDS = enabled


def warm_guards(warm: bool):
    """Dynamo's stance for one call of graphs traced at start: the distinguishing guards only, when `warm` (every
    graph compiled) in a process that allows it (`skip_warm_guards`); otherwise the stance is left as it is."""
    if warm and _SKIP_WARM_GUARDS:
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def call_model(model: PreTrainedModel, **kwargs):
    """What a compiled engine step traces: the model's own forward (its `__call__`, hooks included)."""
    return model(**kwargs)


def dynamo_settings(constant_floats: bool = True):
    """hf_accel's dynamo config patch around its compiled graphs: both recompile limits raised to hf_accel's (never
    lowered), and with `constant_floats` every Python float traced as the constant it is. Rule: a module's float
    attribute (an attention's `scaling`, which reaches the paged-attention op) is otherwise traced as a symbol, the op
    specializes it, and dynamo's tensorify pass then restarts the analysis: the whole graph traced and handed to AOT
    twice, a third of each compile. A call that samples inside its graph passes False, so that its warpers'
    temperature / top-p stay graph inputs and another value reuses the graph."""
    config = torch._dynamo.config
    return config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT),
                        accumulated_recompile_limit=max(config.accumulated_recompile_limit,
                                                        ACCUMULATED_RECOMPILE_LIMIT),
                        specialize_float=constant_floats or config.specialize_float)


@contextlib.contextmanager
def paged_attention_implementation(model: PreTrainedModel, name: str = ATTENTION_NAME) -> Iterator[None]:
    """Run `model` with hf_accel's paged attention (or the registered attention `name`) inside the block, its own
    implementation after (a no-op when already inside one: `Engine` switches once per run of steps, so single steps
    pay nothing)."""
    saved = model.config._attn_implementation
    if saved == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


@dataclass(slots=True)
class StepInputs:
    """One step's packed inputs as host lists: `tokens`, `positions` and `slots` per packed token; `query_start`
    (`seqs + 1` offsets), `kv_lengths` and block `tables` per sequence; `keep`, the packed rows whose logits (and
    hidden states) the step returns."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    kv_lengths: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)

    @classmethod
    def packed(cls, tokens: list[int], entries: list[tuple[list[int], range]], block_size: int) -> StepInputs:
        """`tokens` of several sequences packed in order (`entries`: per sequence, its block ids and the consecutive
        positions of its tokens), each sequence's last token kept."""
        inputs = cls(tokens=tokens, positions=[p for _, span in entries for p in span])
        for blocks, span in entries:
            inputs.slots += token_slots(blocks, span.start, span.stop, block_size)
            inputs.query_start.append(inputs.query_start[-1] + len(span))
            inputs.kv_lengths.append(span.stop)
            inputs.tables.append(blocks[: -(-span.stop // block_size)])
            inputs.keep.append(inputs.query_start[-1] - 1)
        return inputs

    @property
    def is_single_decode(self) -> bool:
        """One sequence, one token, its logits kept: a decode step of a single sequence."""
        return len(self.tokens) == 1 and len(self.kv_lengths) == 1 and len(self.keep) == 1

    def with_table_width(self, width: int) -> StepInputs:
        """The same step with every block table padded to `width` blocks (block 0: never read past a length)."""
        tables = [table + [0] * (width - len(table)) for table in self.tables]
        return StepInputs(self.tokens, self.positions, self.slots, self.query_start, self.kv_lengths, tables, self.keep)

    def padded(self) -> StepInputs:
        """The same step with no size that could be 1 except the token count: an empty sequence (no queries, no
        context) when there is one, block tables at least 2 wide, at least 2 kept rows."""
        tables, query_start, kv_lengths = self.tables, self.query_start, self.kv_lengths
        if len(tables) < 2:
            tables, query_start, kv_lengths = tables + [[]], query_start + [query_start[-1]], kv_lengths + [0]
        keep = self.keep + (self.keep[-1:] or [0]) * (2 - len(self.keep))
        tables = [table + [0] * (2 - len(table)) for table in tables]
        return StepInputs(self.tokens, self.positions, self.slots, query_start, kv_lengths, tables, keep)

    def attention(self, kv: KVPool, attend, device: torch.device) -> StepAttention:
        """The `hf_accel_step` of these inputs over `kv`: slots, block tables padded to one width, query starts and
        context lengths as tensors on `device`."""
        width = max(map(len, self.tables))
        tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        tables = [table + [0] * (width - len(table)) for table in self.tables]
        return StepAttention(kv, tensor(self.slots), tensor(tables), tensor(self.query_start), tensor(self.kv_lengths),
                             attend)


_ONE_TOKEN = StepInputs(tokens=[0], positions=[0], slots=[0], query_start=[0, 1], kv_lengths=[1], tables=[[0]],
                        keep=[0])  # one sequence's first token, in block 0


@dataclass(slots=True)
class ForwardOutput:
    """What one step's forward returns: `logits` `[kept, vocab]` fp32; `hidden` `[kept, hidden]` (the final normed
    state, when kept: Medusa); `features` `[tokens, len(feature_layers) * hidden]` (every packed token's hidden states
    at `feature_layers`, concatenated: an EAGLE head's input)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    features: torch.Tensor | None = None


class StepForward:
    """Runs `model` on `StepInputs` over the pool `kv`, returning a `ForwardOutput`; `keep_hidden`: with the final
    hidden states at the kept rows; `feature_layers`: with those `output_hidden_states` entries at every packed token;
    `compile=True` compiles the forward (see the module docstring), with `max_blocks` (the widest block table a
    sequence can have) also a static graph for single-sequence decode steps; `graphs` replays captured CUDA graphs for
    the steps they cover (`cuda_graphs.DecodeGraphs`)."""

    def __init__(self, model: PreTrainedModel, kv: KVPool, attend, keep_hidden: bool, compile: bool,
                 graphs: DecodeGraphs | None = None, feature_layers: tuple[int, ...] = (),
                 max_blocks: int | None = None):
        self.model, self.kv, self.attend, self.keep_hidden, self.graphs = model, kv, attend, keep_hidden, graphs
        self.feature_layers = feature_layers
        self.device = next(model.parameters()).device
        self.compiled = compile
        self.compile_seconds = 0.0
        self._warm = False  # every graph compiled: steps may skip dynamo's guards
        self._forward = model  # eager: the module's own __call__ (its hooks, its forward as it is at call time)
        self._single = None  # the static single-sequence decode graph
        self.max_blocks = max_blocks if compile and graphs is None else None
        if compile:
            compiled = compiled_for(model, call_model, "engine step",
                                    lambda function: torch.compile(function, dynamic=True, fullgraph=True))
            self._forward = functools.partial(compiled, model)
        if self.max_blocks is not None:
            single = compiled_for(model, call_model, "engine single-sequence step",
                                  lambda function: torch.compile(function, dynamic=False, fullgraph=True))
            self._single = functools.partial(single, model)

    def __call__(self, inputs: StepInputs) -> ForwardOutput:
        kept = len(inputs.keep)
        if self.graphs is not None and len(inputs.tokens) == len(inputs.kv_lengths) == kept:  # one token each
            with paged_attention_implementation(self.model):
                logits = self.graphs.run(inputs.tokens, inputs.positions, inputs.slots, inputs.tables,
                                         inputs.kv_lengths)
            if logits is not None:
                return ForwardOutput(logits)
        if self._single is not None and inputs.is_single_decode:
            return self._run(inputs.with_table_width(self.max_blocks), self._single, kept)
        return self._run(inputs.padded() if self.compiled else inputs, self._forward, kept)

    def _run(self, inputs: StepInputs, forward, kept: int) -> ForwardOutput:
        """`inputs` (padded as `forward`, a graph or the eager model, needs them) through `forward`; the first
        `kept` kept rows are returned."""
        step = inputs.attention(self.kv, self.attend, self.device)
        keep = self._tensor(inputs.keep)
        with torch.inference_mode(), paged_attention_implementation(self.model), \
                symbolic_config.patch(use_duck_shape=False), warm_guards(self._warm):
            out = forward(
                input_ids=self._tensor([inputs.tokens]), position_ids=self._tensor([inputs.positions]),
                use_cache=False, logits_to_keep=keep, hf_accel_step=step,
                output_hidden_states=self.keep_hidden or bool(self.feature_layers),
            )
        hidden = out.hidden_states[-1][0, keep[:kept]] if self.keep_hidden else None
        features = None
        if self.feature_layers:
            features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)
        return ForwardOutput(out.logits[0, :kept].float(), hidden, features)

    def warm_up(self) -> None:
        """Compile the graphs now (a no-op when eager), timing it into `compile_seconds`; where compiling fails
        (a module dynamo cannot trace whole, e.g. weights that repack themselves on first use), warn and run eagerly.
        Writes K/V only into block 0 of a pool that holds nothing yet (an engine at start). Captures the CUDA
        graphs, if any, the same way."""
        started = time.perf_counter()
        if self.graphs is not None:
            with paged_attention_implementation(self.model):
                self.graphs.capture()
            self.compile_seconds = time.perf_counter() - started
        if not self.compiled:
            return
        try:
            if self.feature_layers:  # transformers' capturing hooks get installed by an eager call (see above)
                self._eager_call()
            # each engine's graphs count toward dynamo's process-wide total (accumulated_recompile_limit),
            # which a long notebook or test session would otherwise reach
            with dynamo_settings(), freezing(True, self.model.dtype):
                self._trace_graphs()
            self._warm = True
        except Exception as error:
            warnings.warn(f"hf_accel: compiling the engine's model step failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); the engine runs it eagerly",
                          RuntimeWarning, stacklevel=2)
            self.compiled, self._forward, self._single, self.max_blocks = False, self.model, None, None
        self.compile_seconds = time.perf_counter() - started

    def _eager_call(self) -> None:
        """One token through the model's own forward (K/V into block 0 of the empty pool)."""
        self._run(_ONE_TOKEN, self.model, 1)

    def _trace_graphs(self) -> None:
        """The dynamic graphs (one token; several: two sequences), then the single-sequence one."""
        size = self.kv.block_size
        for num_tokens in (1, 3):
            lengths = [num_tokens] if num_tokens == 1 else [1, num_tokens - 1]
            inputs = StepInputs(tokens=[0] * num_tokens, positions=[0] + list(range(num_tokens - 1)),
                                slots=list(range(num_tokens)), keep=list(range(num_tokens)))
            for length in lengths:
                inputs.query_start.append(inputs.query_start[-1] + length)
                inputs.kv_lengths.append(length)
                inputs.tables.append([0] * -(-length // size))
            self._run(inputs.padded(), self._forward, num_tokens)
        if self._single is not None:
            self(_ONE_TOKEN)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
