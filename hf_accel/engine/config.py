"""`EngineConfig`: the engine's limits, validated once; the pool size follows from memory and the model's K/V."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cache.paged_config import parse_bytes
from ..cache.settings import check_int
from .scheduler import SchedulerConfig

if TYPE_CHECKING:
    from .spec_decode.speculative_config import SpeculativeConfig


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Limits of the engine: `Engine(model, tokenizer, config=EngineConfig(max_num_seqs=8, kv_cache_memory="1GiB"))`.

    Args:
        max_num_seqs: most sequences running at once (a request with `n` samples counts `n`).
        max_num_batched_tokens: most tokens computed in one step (decodes plus prefill chunks).
        kv_cache_memory: bytes (or e.g. `"2GiB"`) for K and V of all layers; default: room for `max_num_seqs`
            sequences of `max_model_len` tokens, so nothing is ever preempted.
        block_size: tokens per KV block.
        enable_prefix_caching: reuse the K/V of full blocks of earlier prompts.
        max_model_len: longest sequence (prompt plus output); default: the model's `max_position_embeddings`.
        enforce_eager: run the model's forward eagerly. By default it is compiled with `torch.compile` once, when the
            engine starts (`EngineStats.compile_seconds`), wherever the in-place attention kernel is built (CPU), except
            with Medusa speculation (its step returns hidden states, which transformers captures in a way dynamo
            cannot trace whole). The compiled forward packs a copy of each Linear's weight at engine start
            (fp32: into panels for hf_accel's kernel, `kernels/linear_panels.py`; else for oneDNN, inductor's
            `freezing`), so weights changed in place later reach that engine only in part:
            build a new engine after changing them, or pass `enforce_eager=True`.
        compile_in_background: compile the model step in a thread while the engine serves eagerly, switching to
            the graphs at the first step after they are ready (`Engine.compiling`): requests never wait for a
            compile, at the price of slower eager steps (and a slower compile) meanwhile. Not with a proposer that
            compiles graphs of its own (EAGLE, draft model): those engines compile at start.
        structured_jump_forward: where a constrained request's grammar forces its next tokens (a JSON key, closing
            brackets), verify them as candidates in the step's forward (jump-forward decoding; outputs unchanged,
            `spec_decode/jump_forward.py`).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    enforce_eager: bool = False
    compile_in_background: bool = False
    structured_jump_forward: bool = True

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1, "a positive int")
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, "a positive int")
        check_int("block_size", self.block_size, 1, "a positive int")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1, "a positive int or None")
        for name in ("enable_prefix_caching", "enforce_eager", "compile_in_background", "structured_jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}")

    def num_blocks(self, bytes_per_token: int, max_model_len: int) -> int:
        """Blocks in the pool; ValueError if they cannot hold one sequence of `max_model_len` tokens."""
        blocks_per_seq = -(-max_model_len // self.block_size)
        if self.kv_cache_memory is None:
            return self.max_num_seqs * blocks_per_seq
        num = self.kv_cache_memory // (bytes_per_token * self.block_size)
        if num < blocks_per_seq:
            need = blocks_per_seq * bytes_per_token * self.block_size
            raise ValueError(f"`kv_cache_memory` ({self.kv_cache_memory} bytes) cannot hold one sequence of "
                             f"max_model_len={max_model_len} tokens ({need} bytes); raise it or lower max_model_len")
        return num

    def scheduler_config(self, speculative: SpeculativeConfig | None) -> SchedulerConfig:
        """One step's limits: these, and with `speculative` its candidates per sequence and batch-token rule."""
        if speculative is None:
            return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, speculative.num_candidates,
                               speculative.batch_tokens)
