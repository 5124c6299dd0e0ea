"""One model forward per engine step: the scheduled tokens of every sequence packed into one row.

The model runs its own, unmodified forward (through `step_forward.StepForward`: compiled once per engine, or eager)
with `attn_implementation` switched to hf_accel's paged attention for the call (restored after), `use_cache=False`
(K/V live in the engine's pool, written by the attention function), per-token `position_ids`, and `logits_to_keep`
set to the last token of each sequence that samples this step, plus its candidates when it speculates. When the
proposer needs them (Medusa), the same forward also returns the final (normed) hidden states at those positions
(`output_hidden_states`: transformers ties the last entry to the normed output); for an EAGLE head, the hidden states
of its feature layers at every packed token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..runtime.attention import gathered_attention
from ..runtime.kv_pool import KVPool, token_slots
from ..kernels.custom_ops import paged_attention_kernel
from .scheduler import ScheduledBatch, ScheduledSeq
from .sequence import Sequence
from ..runtime.cuda_graphs import DecodeGraphs
from ..runtime.step_forward import StepForward
from ..runtime.step_inputs import StepInputs


@dataclass(slots=True)
class StepOutput:
    """The kept positions of one step: `logits` `[rows, vocab]` fp32 and, when asked, `hidden` `[rows, hidden]`.
    `sampling[i]` (a scheduled sequence whose last token the step computed) owns the rows `rows(i)`: its last
    token's, then one per candidate. With feature layers, `features` `[tokens, F]` holds every packed token's
    features; `batch.scheduled[j]` owns the rows from `token_starts[j]` (its `num_new` tokens, in order)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    sampling: list[ScheduledSeq]
    starts: list[int]  # first row of each sampling sequence
    features: torch.Tensor | None = None
    token_starts: list[int] | None = None  # first packed token of each scheduled sequence

    def rows(self, i: int) -> slice:
        return slice(self.starts[i], self.starts[i] + 1 + self.sampling[i].num_drafts)

    def committed_features(self, scheduled: list[ScheduledSeq],
                           num_accepted: dict[int, int]) -> list[tuple[Sequence, int, torch.Tensor]]:
        """Per unfinished scheduled sequence (`scheduled`: the batch's, in order): its first position this step
        computed and the features `[n, F]` of the positions it commits (the rows `Scheduler.postprocess` counts:
        its real tokens, then the candidates it kept)."""
        committed = []
        for s, start in zip(scheduled, self.token_starts):
            if not s.seq.is_finished:
                count = s.num_new - s.num_drafts + num_accepted.get(s.seq.seq_id, 0)
                committed.append((s.seq, s.seq.num_computed_tokens, self.features[start : start + count]))
        return committed


def uses_cuda_graphs(device: torch.device, enforce_eager: bool, keep_hidden: bool) -> bool:
    """Whether an engine's decode steps replay CUDA graphs: on CUDA, unless eager is enforced or hidden states are
    kept (Medusa)."""
    return device.type == "cuda" and not enforce_eager and not keep_hidden


class ModelRunner:
    """Runs scheduled batches of `model` over the block pool `kv` (`keep_hidden`: also return hidden states;
    `enforce_eager`: never compile the forward, which is otherwise compiled where the in-place kernel is built and no
    hidden states are kept, and on CUDA never capture decode steps; `max_num_seqs` and `max_model_len` size the
    CUDA graphs; `compile_in_background`: steps run eagerly while the graphs compile in a thread, `kv` having a
    spare block; `graph_inputs`: tensors the model's hooks read that stay inputs of the compiled graphs)."""

    def __init__(self, model: PreTrainedModel, kv: KVPool, keep_hidden: bool = False, enforce_eager: bool = False,
                 max_num_seqs: int = 1, max_model_len: int = 1, feature_layers: tuple[int, ...] = (),
                 compile_in_background: bool = False,
                 graph_inputs: Callable[[], tuple[torch.Tensor, ...]] | None = None):
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(f"`model` ({type(model).__name__}) does not use transformers' AttentionInterface, "
                             "which the engine needs")
        self.model, self.kv = model, kv
        device = next(model.parameters()).device
        # built (or found in torch's cache) now, once per engine; the kernel is CPU code
        kernel = paged_attention_kernel() if device.type == "cpu" else None
        self.attend = kernel if kernel is not None else gathered_attention
        # with Medusa heads the step also returns hidden states, which transformers captures with a context manager
        # dynamo cannot trace: those engines run eagerly
        compile = kernel is not None and not enforce_eager and not keep_hidden
        graphs = None
        if uses_cuda_graphs(device, enforce_eager, keep_hidden or bool(feature_layers)):  # decode steps: graphs
            graphs = DecodeGraphs(model, kv, max_num_seqs, max_model_len)
        self.forward = StepForward(model, kv, self.attend, keep_hidden, compile=compile, graphs=graphs,
                                   feature_layers=feature_layers, max_blocks=-(-max_model_len // kv.block_size),
                                   graph_inputs=graph_inputs)
        self.forward.warm_up(background=compile_in_background and compile and graphs is None)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step; keeps the rows of the sequences whose last token this step computes (and their
        candidates, `draft_token_ids`, `num_drafts` of them)."""
        inputs, sampling, starts, token_starts = StepInputs(), [], [], []
        size = self.kv.block_size
        for scheduled in batch.scheduled:
            seq, num, drafts = scheduled.seq, scheduled.num_new, scheduled.num_drafts
            start, first = len(inputs.tokens), seq.num_computed_tokens
            token_starts.append(start)
            inputs.tokens += seq.token_ids[first : first + num - drafts] + scheduled.draft_token_ids
            inputs.positions += range(first, first + num)
            inputs.slots += token_slots(seq.block_ids, first, first + num, size)
            inputs.query_start.append(len(inputs.tokens))
            inputs.kv_lengths.append(first + num)
            inputs.tables.append(seq.block_ids[: -(-(first + num) // size)])
            if scheduled.samples:
                starts.append(len(inputs.keep))
                inputs.keep += range(start + num - 1 - drafts, start + num)
                sampling.append(scheduled)
        out = self.forward(inputs)
        return StepOutput(out.logits, out.hidden, sampling, starts, out.features, token_starts)
