"""The model forward of one engine step, eager or compiled once per engine with `torch.compile`.

Compiled (the default where the in-place kernel is built; `enforce_eager=True` turns it off, vLLM's name), the model's
own forward runs through inductor with dynamic shapes: the packed token count, the number of sequences, the block
table's width and the kept rows may change every step without recompiling. The attention is one opaque custom op
(`torch.ops.hf_accel.paged_attention`, mutating the pools in place), so the graph is whole (`fullgraph=True`). Two rules
keep it to two graphs (one token, several tokens; one beside the single-sequence graph below): sizes are never
duck-shaped into one symbol because they happen to be equal when traced, and the sizes that can be 1 (sequences,
block-table width, kept rows), which torch would specialize, are padded to at least 2 (an empty sequence, a column of
block 0, the last kept row repeated: none changes a result). A step of one token (one sequence decoding: the
latency-bound case of one request streaming, or a prompt's last uncached token) runs a graph with static shapes instead
(`max_blocks` given: its block table padded to the engine's widest, its one kept row kept even where the step keeps
none), the way vLLM captures fixed sizes: no symbolic sizes to compute or guard on; the dynamic graph of one token is
then never traced (a third of the compile, at every start). All graphs are traced and compiled in `warm_up`, at engine
start, so `compile_seconds` is the whole cost and no request waits for a compile; on-disk caches make a restart
cheaper: built C++ kernels, and the fp32 step functions themselves, run without guards and saved whole where the
model has no hooks but self-described ones such as LoRA's (`saved_steps.py`: a new process loads them, tracing
nothing). `warm_up(background=True)` compiles them in a thread instead while steps run eagerly (`compiling`), and the
first step after the thread is done switches to them: an engine then serves from its first second. The thread writes
only into the pool's spare block (which the allocator never hands out) and shares the step's switches (`stepping`);
it holds the interpreter lock for most of its tracing, so eager steps meanwhile are slower, and the compile too.
Steps that run through dynamo (other dtypes, hidden states kept) skip its guards after the warm-up in the engine-core
process (`EngineProcess`; an EAGLE head's passes too: `skip_guard_eval_unsafe`, only the guards that tell the graphs
apart run; `warm_guards`), since every step's inputs differ from the warmed ones in sizes and values only, and the
full guards are a visible share of a small model's step. Everywhere, the graphs carry no guards on module hooks
(`dynamo.without_hook_guards`: half a millisecond a step): the hooks the model has when they trace are part of their
key instead. Only there: dynamo's stance is process-wide, and beside an in-process engine other threads may run
compiled code whose guards must run (`skip_warm_guards`).
Each Linear runs over a weight packed once. fp32 on the CPU: hf_accel's kernel over column panels, packed when the
engine is built and set as the Linears' forwards while steps run (`kernels/linear_panels.py`; `stepping` holds them,
with the attention switch, for a run of steps), so the graphs take panels and weights as inputs and hold none. Other
dtypes freeze the weights into the graphs (inductor's `freezing`, oneDNN's packing). Graphs and panels are kept per
model and its weights (`frozen_graphs.py`): engines on one unchanged model share them, changed weights get new ones.
On a GPU, decode steps replay CUDA graphs instead (`cuda_graphs.py`), captured in the same warm-up.
With `feature_layers` (an EAGLE head's inputs) the step also returns those hidden states at every packed token,
compiled too: transformers installs its hidden-state capturing hooks on the first call, behind a lock dynamo cannot
trace, so one eager call installs them before the graphs are traced.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as symbolic_config
from transformers import PreTrainedModel

from ..registry import attention_implementation
from .attention import ATTENTION_NAME
from .cuda_graphs import DecodeGraphs
from .dynamo import (begin_background_compile, dynamo_settings, end_background_compile, hooks_key, warm_guards,
                     without_hook_guards)
from .frozen_graphs import compiled_for, panels_for, step_graph_settings
from .kv_pool import KVPool
from .saved_steps import SavedStep, enabled as saved_steps_enabled, hook_descriptions, model_description
from .step_inputs import StepInputs


def call_model(model: PreTrainedModel, graph_inputs: tuple[torch.Tensor, ...] = (), **kwargs):
    """What a compiled engine step traces: the model's own forward (its `__call__`, hooks included). `graph_inputs`
    are tensors the model's hooks read whose values change between steps (LoRA adapters' slots): reached through
    the model's modules, dynamo would make them graph constants, which inductor's freezing then folds; touched here
    first, they are the graph's inputs (dynamo tracks a tensor once, whichever way it is reached after)."""
    for tensor in graph_inputs:
        torch._check(tensor.dim() >= 0)  # realizes the input; no guard, no graph node
    return model(**kwargs)


def _compile_step(function: Callable, dynamic: bool) -> Callable:
    """An engine step's `torch.compile`: one whole graph, no guards on module hooks (`dynamo.without_hook_guards`)."""
    return torch.compile(function, dynamic=dynamic, fullgraph=True, options={"guard_filter_fn": without_hook_guards})


def _one_token(block: int, block_size: int) -> StepInputs:
    """One sequence's first token, written into `block`."""
    return StepInputs(tokens=[0], positions=[0], slots=[block * block_size], query_start=[0, 1], kv_lengths=[1],
                      tables=[[block]], keep=[0])


class _Cancelled(Exception):
    """A background compile stopped by `StepForward.cancel_compile`."""


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
    the steps they cover (`cuda_graphs.DecodeGraphs`); `graph_inputs` gives the tensors the model's hooks read that
    must stay inputs of the compiled graphs (`call_model`)."""

    def __init__(self, model: PreTrainedModel, kv: KVPool, attend, keep_hidden: bool, compile: bool,
                 graphs: DecodeGraphs | None = None, feature_layers: tuple[int, ...] = (),
                 max_blocks: int | None = None, graph_inputs: Callable[[], tuple[torch.Tensor, ...]] | None = None):
        self.model, self.kv, self.attend, self.keep_hidden, self.graphs = model, kv, attend, keep_hidden, graphs
        self.graph_inputs = graph_inputs
        self.feature_layers = feature_layers
        self.device = next(model.parameters()).device
        self.compiled = False  # whether steps run the graphs (from the end of a compile, see `warm_up`)
        self._compile_wanted = compile
        self.compile_seconds = 0.0
        self._warm = False  # every graph compiled: steps may skip dynamo's guards
        self._forward = model  # eager: the module's own __call__ (its hooks, its forward as it is at call time)
        self._single = None  # the static single-sequence decode graph
        self.max_blocks = max_blocks if compile and graphs is None else None
        # fp32 CPU steps run their Linears over panels packed once (see the module docstring); None: none packed
        self._panels = panels_for(model) if compile and graphs is None and model.dtype == torch.float32 else None
        # warm-up writes go to the spare block where the pool has one (steps may run meanwhile), else to block 0
        self._scratch = kv.spare_block if kv.spare_block is not None else 0
        self._compiler: threading.Thread | None = None  # the background compile, while it runs
        self._compiled_graphs: tuple | None = None  # (forward, single) compiled in the background, to switch to
        self._cancelled = False  # set by `cancel_compile`: the background compile stops at its next graph

    def _compiled_functions(self) -> tuple[Callable, Callable | None]:
        """The compiled step functions (the single-sequence one None without `max_blocks`), kept per model, its
        weights and the hooks it has now (`dynamo.hooks_key`: the graphs carry no guards on them); where `_guardless`,
        run without guards (`saved_steps.SavedStep`: then also kept per pool layout) and saved on disk where every
        hook is described (`saved_steps.hook_descriptions`) and saving is on."""
        hooks = hooks_key(self.model)
        guardless = self._guardless()
        persist = guardless and saved_steps_enabled() and hook_descriptions(self.model) is not None
        layout = (tuple(self.kv.keys[0].shape), self.kv.keys[0].dtype, self.max_blocks) if guardless else ()

        def compiled(name: str, dynamic: bool) -> Callable:
            describe_model = functools.partial(model_description, panels=self._panels.layout) if guardless else None
            compile = (functools.partial(SavedStep, dynamic=dynamic, name=name, describe_model=describe_model,
                                         persist=persist)
                       if guardless else functools.partial(_compile_step, dynamic=dynamic))
            function = compiled_for(self.model, call_model, (name, hooks, *layout), compile)
            return functools.partial(function, self.model)

        single = None if self.max_blocks is None else compiled("engine single-sequence step", dynamic=False)
        return compiled("engine step", dynamic=True), single

    def _guardless(self) -> bool:
        """Whether the compiled steps run without guards (`saved_steps.py`): graphs over kept panels (they hold no
        weight) returning nothing but logits, one-token steps running the static graph (the dynamic one must never
        see a size it would specialize). What guards would check is the function's key instead: model, weights,
        hooks, pool layout; the hooks' tensors that change are step inputs (`graph_inputs`)."""
        return (self._panels is not None and self.max_blocks is not None and not self.feature_layers
                and not self.keep_hidden)

    @property
    def compiling(self) -> bool:
        """Whether the graphs are compiling in the background (steps run eagerly until the first one after)."""
        compiler = self._compiler  # read once: the stepping thread may clear it meanwhile (any thread may ask)
        return compiler is not None and self._compiled_graphs is None and compiler.is_alive()

    def cancel_compile(self) -> None:
        """Stop a background compile at its next graph (the engine shuts down: nothing will step); steps stay eager."""
        self._cancelled = True

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Within: the model as steps run it (hf_accel's attention; fp32 Linears over their panels), so a run of steps
        inside switches once, not at every step (each step enters it again, which then costs nothing)."""
        panels = self._panels.installed() if self._panels is not None else contextlib.nullcontext()
        with attention_implementation(self.model, ATTENTION_NAME), panels:
            yield

    def __call__(self, inputs: StepInputs) -> ForwardOutput:
        if self._compiled_graphs is not None:
            self._switch_to_graphs()
        kept = len(inputs.keep)
        if self.graphs is not None and len(inputs.tokens) == len(inputs.kv_lengths) == kept:  # one token each
            with attention_implementation(self.model, ATTENTION_NAME):
                logits = self.graphs.run(inputs.tokens, inputs.positions, inputs.slots, inputs.tables,
                                         inputs.kv_lengths)
            if logits is not None:
                return ForwardOutput(logits)
        if self._single is not None and len(inputs.tokens) == 1:  # one sequence (a scheduled one has a token)
            return self._run(inputs.with_table_width(self.max_blocks).keeping_one(), self._single, kept, graph=True)
        if self.compiled:
            return self._run(inputs.padded(), self._forward, kept, graph=True)
        return self._run(inputs, self._forward, kept, graph=False)  # the model's own forward

    def _run(self, inputs: StepInputs, forward, kept: int, graph: bool) -> ForwardOutput:
        """`inputs` (padded as `forward`, a graph (`graph`) or the eager model, needs them) through `forward`; the
        first `kept` kept rows are returned."""
        step = inputs.attention(self.kv, self.attend, self.device)
        keep = self._tensor(inputs.keep)
        # dynamo's config is process-wide: eager steps beside a background compile must not patch it
        traced = symbolic_config.patch(use_duck_shape=False) if graph else contextlib.nullcontext()
        extra = {"graph_inputs": self.graph_inputs()} if graph and self.graph_inputs is not None else {}
        with torch.inference_mode(), self.stepping(), traced, warm_guards(self._warm and graph):
            out = forward(
                input_ids=self._tensor([inputs.tokens]), position_ids=self._tensor([inputs.positions]),
                use_cache=False, logits_to_keep=keep, hf_accel_step=step,
                output_hidden_states=self.keep_hidden or bool(self.feature_layers), **extra,
            )
        hidden = out.hidden_states[-1][0, keep[:kept]] if self.keep_hidden else None
        features = None
        if self.feature_layers:
            features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)
        return ForwardOutput(out.logits[0, :kept].float(), hidden, features)

    def warm_up(self, background: bool = False) -> None:
        """Compile the graphs now (a no-op when eager), timing it into `compile_seconds`; where compiling fails
        (a module dynamo cannot trace whole, e.g. weights that repack themselves on first use), warn and run eagerly.
        Writes K/V only into the pool's spare block, or block 0 of a pool that holds nothing yet (an engine at
        start). Captures the CUDA graphs, if any, the same way. `background` (a pool with a spare block): compile in
        a thread and run steps eagerly until it is done (`compiling`)."""
        started = time.perf_counter()
        if self.graphs is not None:
            with attention_implementation(self.model, ATTENTION_NAME):
                self.graphs.capture()
            self.compile_seconds = time.perf_counter() - started
        if not self._compile_wanted:
            return
        if not background:
            self._compile(started)
            return
        if self.kv.spare_block is None:
            raise ValueError("a background compile needs a pool with a spare block (`KVPool(spare_block=True)`)")
        self._compiler = threading.Thread(target=self._compile, args=(started, True), name="hf_accel-compile",
                                          daemon=True)
        begin_background_compile()
        self._compiler.start()

    def _compile(self, started: float, background: bool = False) -> None:
        """Trace and compile the step's graphs; steps use them after (at once, or from the first step after a
        `background` compile); on failure, warn and keep the eager forward."""
        graphs = None
        try:
            if self.feature_layers:  # transformers' capturing hooks get installed by an eager call (see above)
                self._run(_one_token(self._scratch, self.kv.block_size), self.model, 1, graph=False)
            forward, single = self._compiled_functions()
            # each engine's graphs count toward dynamo's process-wide total (accumulated_recompile_limit),
            # which a long notebook or test session would otherwise reach; steps over panels freeze nothing (a
            # saved step's key stands for the inputs' sizes and strides that step_graph_settings asserts no more)
            with dynamo_settings(), step_graph_settings(self._panels is None, self.model.dtype):
                self._trace_graphs(forward, single)
            graphs = (forward, single)
        except _Cancelled:  # the engine shut down: nothing to warn about
            pass
        except Exception as error:
            warnings.warn(f"hf_accel: compiling the engine's model step failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); the engine runs it eagerly",
                          RuntimeWarning, stacklevel=3)
        finally:
            self.compile_seconds = time.perf_counter() - started  # before the graphs show: whoever sees them sees it
            if background:
                end_background_compile()
        if graphs is None:
            self.max_blocks = None
        elif background:
            self._compiled_graphs = graphs  # the next step switches (in its own thread)
        else:
            (self._forward, self._single), self.compiled = graphs, True
            self._warm = True

    def _switch_to_graphs(self) -> None:
        """From the eager forward to the graphs a background compile made (between steps, in the stepping thread)."""
        (self._forward, self._single), self._compiled_graphs = self._compiled_graphs, None
        self.compiled = self._warm = True
        self._compiler = None

    def _trace_graphs(self, forward, single) -> None:
        """The dynamic graphs (one token, unless the single-sequence graph runs those steps; several: two
        sequences), then the single-sequence one, writing K/V into the scratch block."""
        size, block = self.kv.block_size, self._scratch
        for num_tokens in (3,) if single is not None else (1, 3):
            self._check_cancelled()
            lengths = [num_tokens] if num_tokens == 1 else [1, num_tokens - 1]
            # every write inside the scratch block, whatever the block size (what is read there is never used)
            inputs = StepInputs(tokens=[0] * num_tokens, positions=[0] + list(range(num_tokens - 1)),
                                slots=[block * size + i % size for i in range(num_tokens)],
                                keep=list(range(num_tokens)))
            for length in lengths:
                inputs.query_start.append(inputs.query_start[-1] + length)
                inputs.kv_lengths.append(length)
                inputs.tables.append([block] * -(-length // size))
            self._run(inputs.padded(), forward, num_tokens, graph=True)
        if single is not None:
            self._check_cancelled()
            self._run(_one_token(block, size).with_table_width(self.max_blocks), single, 1, graph=True)

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise _Cancelled()

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
