"""The whole decode step of compiled generate, as one graph: attention metadata from the positions, the model's own
forward (attention in place over the pool, `runtime/attention.py`), and the next-token choice (`token_choice.py`).

Compiled with `fullgraph=True` (no graph break anywhere: the attention is one opaque custom op) and dynamic sizes, so
the number of rows and the block table's width are symbols: one graph serves every call of a model at a batch size
above 1 (a batch of 1 is specialized by the compiler: a second graph), whatever the prompt and output lengths, with
no recompilation per token. Compiled functions are kept per model and `CompileConfig` (backend, mode, options), and
on CPU freeze the model's weights into their graphs (`compile_context`); a model whose weights changed since gets
new ones (`runtime/frozen_graphs.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.fx.experimental._config as symbolic_config
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import CompileConfig

from ..cache.kv_shape import FULL_AND_SLIDING, KVShape
from ..runtime.kv_pool import KVPool
from ..runtime.frozen_graphs import compiled_for, step_graph_settings
from ..runtime.dynamo import dynamo_settings
from ..runtime.attention import StepAttention
from .paged_rows import decode_attention_inputs, table_slots
from .sink_rows import SinkRows
from .token_choice import choose_tokens


def model_uncovered(model: PreTrainedModel) -> str | None:
    """Why `model` cannot run the compiled steps (its attention not through transformers' `AttentionInterface`, or
    K/V the paged pool cannot hold), or None when it can."""
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not use transformers' AttentionInterface"
    try:
        KVShape.from_config(model.config, FULL_AND_SLIDING)
    except ValueError as error:
        return str(error)
    return None


def decode_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                block_table: torch.Tensor, attend: Callable, warpers: tuple, do_sample: bool,
                return_logits: bool, sinks: SinkRows | None = None,
                bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Row `r` computes token `tokens[r]` at `positions[r]` -> `[rows]` next tokens (among those a grammar's
    `bitmask` `[rows, words]` allows, when given), or with `return_logits` the `[rows, vocab]` fp32 logits (for
    processors applied outside the graph); `sinks`: the sink cache's window."""
    full_window = 0
    if sinks is not None:
        sinks.place(kv, block_table, positions)
        full_window = sinks.full_window
    attention = decode_attention_inputs(kv, block_table, positions, attend, full_window)
    out = model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, hf_accel_step=attention)
    logits = out.logits[0].float()
    if return_logits:
        return logits
    return choose_tokens(logits, warpers, do_sample, bitmask)


def verify_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                block_table: torch.Tensor, attend: Callable, return_logits: bool = False) -> torch.Tensor:
    """Row `r` computes the `n` tokens `tokens[r]` `[rows, n]` at positions `positions[r] .. positions[r] + n - 1`
    (a last token and its candidates, speculative decoding's verify forward) -> `[rows, n]` greedy next tokens, or
    with `return_logits` their `[rows, n, vocab]` fp32 logits (for sampling).
    Their K/V are written in place; a later step that starts lower overwrites the rejected ones (rollback is a
    position, not a copy)."""
    logits = _verify_forward(model, tokens, positions, kv, block_table, attend, False).logits[0].float()
    logits = logits.view(*tokens.shape, -1)
    return logits if return_logits else logits.argmax(dim=-1)


def verify_features_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                         block_table: torch.Tensor, attend: Callable, feature_layers: tuple[int, ...],
                         return_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_step`'s result (greedy next tokens `[rows, n]`, or with `return_logits` fp32 logits `[rows, n,
    vocab]`), and the hidden states `feature_layers` index in the model's `output_hidden_states` at each of the
    tokens, concatenated: `[rows, n, len(feature_layers) * H]` (an EAGLE head's input)."""
    out = _verify_forward(model, tokens, positions, kv, block_table, attend, True)
    features = torch.cat([out.hidden_states[i][0] for i in feature_layers], dim=-1).view(*tokens.shape, -1)
    logits = out.logits[0].float().view(*tokens.shape, -1)
    return (logits if return_logits else logits.argmax(dim=-1)), features


def tree_verify_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor,
                     tree_mask: torch.Tensor, kv: KVPool, block_table: torch.Tensor, attend: Callable,
                     feature_layers: tuple[int, ...] = (-1,)) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `r` verifies a tree of `n` nodes, `tokens[r]` `[rows, n]` (node 0 its last token, ancestors before
    descendants), written to the `n` slots from `positions[r]` and computed at positions `positions[r] + depths`
    (`depths` `[n]`, or `[rows, n]` for a tree per row), each node seeing the context and the nodes `tree_mask`
    `[rows, n, n]` allows -> greedy next tokens `[rows, n]` and the hidden states `feature_layers` index in the
    model's `output_hidden_states`, concatenated: `[rows, n, len(feature_layers) * H]` (the last: what Medusa heads
    read; an EAGLE head's fused layers). Rejected nodes' K/V stay in their slots until a later step overwrites them;
    the accepted path is moved into place outside (`KVPool.move_slots`)."""
    rows, num = tokens.shape
    columns = positions[:, None] + torch.arange(num, device=positions.device)  # [rows, n]
    slots = table_slots(block_table, columns, kv.block_size).reshape(-1)
    query_start = torch.arange(rows + 1, device=positions.device) * num
    attention = StepAttention(kv, slots, block_table, query_start, positions + num, attend, tree_mask=tree_mask)
    out = model(input_ids=tokens.reshape(1, -1), position_ids=(positions[:, None] + depths).reshape(1, -1),
                use_cache=False, output_hidden_states=True, hf_accel_step=attention)
    logits = out.logits[0].float().view(rows, num, -1)
    features = torch.cat([out.hidden_states[i][0] for i in feature_layers], dim=-1)
    return logits.argmax(dim=-1), features.view(rows, num, -1)


def _verify_forward(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                    block_table: torch.Tensor, attend: Callable, hidden_states: bool):
    rows, num = tokens.shape
    at = positions[:, None] + torch.arange(num, device=positions.device)  # [rows, n]
    slots = table_slots(block_table, at, kv.block_size).reshape(-1)
    query_start = torch.arange(rows + 1, device=positions.device) * num
    attention = StepAttention(kv, slots, block_table, query_start, positions + num, attend)
    return model(input_ids=tokens.reshape(1, -1), position_ids=at.reshape(1, -1), use_cache=False,
                 output_hidden_states=hidden_states, hf_accel_step=attention)


def compiled_decode_step(config: CompileConfig, model: PreTrainedModel) -> Callable[..., torch.Tensor]:
    """`decode_step` compiled for `model` with `config`'s backend, mode and options (always whole and dynamic)."""
    return _compiled(model, decode_step, config)


def compiled_verify_step(config: CompileConfig, model: PreTrainedModel) -> Callable[..., torch.Tensor]:
    """`verify_step` compiled for `model` like `compiled_decode_step`."""
    return _compiled(model, verify_step, config)


def compiled_verify_features_step(config: CompileConfig, model: PreTrainedModel) -> Callable[..., tuple]:
    """`verify_features_step` compiled for `model` like `compiled_decode_step`."""
    return _compiled(model, verify_features_step, config)


def compiled_tree_verify_step(config: CompileConfig, model: PreTrainedModel) -> Callable[..., tuple]:
    """`tree_verify_step` compiled for `model` like `compiled_decode_step`."""
    return _compiled(model, tree_verify_step, config)


def _compiled(model: PreTrainedModel, function: Callable, config: CompileConfig) -> Callable[..., torch.Tensor]:
    return compiled_with(config, model, function)


def compiled_with(config: CompileConfig, owner: torch.nn.Module, function: Callable,
                  companions: tuple[torch.nn.Module, ...] = ()) -> Callable:
    """`function` compiled whole and dynamic with `config`'s backend, mode and options, kept for `owner` (and the
    `companions` whose weights its graphs also hold) by `frozen_graphs.compiled_for`."""
    options = tuple(sorted((config.options or {}).items()))
    mode = inductor_mode(config.mode)
    settings = {"options": dict(options)} if options else {"mode": mode}  # torch.compile takes one or the other
    return compiled_for(owner, function, (function.__name__, config.backend, mode, options),
                        lambda copy: torch.compile(copy, fullgraph=True, dynamic=True, backend=config.backend,
                                                   **settings), companions)


# CompileConfig modes whose inductor graphs would be CUDA graphs -> the same mode without them
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def inductor_mode(mode: str | None) -> str | None:
    """The mode hf_accel's steps are compiled with for `CompileConfig.mode`: a mode with CUDA graphs
    ("reduce-overhead", the default, or "max-autotune") becomes the same mode without them, since inductor's graphs
    skip a step whose K/V pool is written in place; the plain decode loop captures its compiled step itself
    (`captured_step.py`)."""
    return WITHOUT_CUDA_GRAPHS.get(mode, mode)


@contextlib.contextmanager
def compile_context(device: torch.device, config: CompileConfig, dtype: torch.dtype,
                    sampling: bool = False) -> Iterator[None]:
    """Around a decode loop of a `dtype` model on `device`: sizes that happen to be equal when traced stay separate
    symbols (duck shaping off), dynamo's settings are hf_accel's (`dynamo_settings`: recompile limits raised, as a
    long session compiles more than dynamo's default total; floats traced as constants unless the loop is `sampling`
    inside its graphs), inductor's are `step_graph_settings`' (no size asserts at each call), and on CPU graphs
    compiled here freeze the weights (inductor's `freezing`: each Linear runs over a weight packed once, a copy kept
    with the graph: fp32 ones through hf_accel's kernel for a few rows, `kernels/packed_linear.py`, others through
    oneDNN, both faster than MKL's sgemm on the weights as they lie at a few rows), unless `config.options` says
    `"freezing": False`."""
    freeze = device.type == "cpu" and (config.options or {}).get("freezing", True)
    with symbolic_config.patch(use_duck_shape=False), dynamo_settings(constant_floats=not sampling), \
            step_graph_settings(freeze, dtype):
        yield


def generate_context(device: torch.device, config: GenerationConfig, dtype: torch.dtype):
    """`compile_context` for a `generate` call's decode loop: its `compile_config`, sampling when it samples."""
    return compile_context(device, config.compile_config, dtype, bool(config.do_sample))
