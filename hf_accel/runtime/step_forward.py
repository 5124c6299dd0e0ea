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
on-disk caches make a restart cheaper: built C++ kernels, and the compiled graphs themselves, keyed by a
fingerprint of the weights they freeze (`frozen_graphs.freezing`).
In the engine-core process (`EngineProcess`), steps (and an EAGLE head's passes) after the warm-up skip dynamo's
guards (`skip_guard_eval_unsafe`: only the guards that tell the graphs apart run; `warm_guards`), since every step's
inputs differ from the warmed ones in sizes and values only, and the full guards are a visible share of a small
model's step.
Only there: dynamo's stance is process-wide, and beside an in-process engine other threads may run compiled code
whose guards must run (`skip_warm_guards`).
The weights are frozen into the graphs (inductor's `freezing`), so each Linear runs over a weight packed once (fp32:
hf_accel's kernel over column panels, `kernels/packed_linear.py`; else oneDNN's matmul); the graphs are kept per model
and its weights (`frozen_graphs.py`), so engines on the same unchanged model share them and a model whose weights
changed gets new ones.
On a GPU, decode steps replay CUDA graphs instead (`cuda_graphs.py`), captured in the same warm-up.
With `feature_layers` (an EAGLE head's inputs) the step also returns those hidden states at every packed token,
compiled too: transformers installs its hidden-state capturing hooks on the first call, behind a lock dynamo cannot
trace, so one eager call installs them before the graphs are traced.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as symbolic_config
from transformers import PreTrainedModel

from ..registry import attention_implementation
from .attention import ATTENTION_NAME
from .cuda_graphs import DecodeGraphs
from .dynamo import dynamo_settings, warm_guards
from .frozen_graphs import compiled_for, freezing
from .kv_pool import KVPool
from .step_inputs import StepInputs


def call_model(model: PreTrainedModel, **kwargs):
    """What a compiled engine step traces: the model's own forward (its `__call__`, hooks included)."""
    return model(**kwargs)


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
            with attention_implementation(self.model, ATTENTION_NAME):
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
        with torch.inference_mode(), attention_implementation(self.model, ATTENTION_NAME), \
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
            with attention_implementation(self.model, ATTENTION_NAME):
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
