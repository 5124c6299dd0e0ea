"""`EngineAdapters`: an engine's LoRA adapters (`EngineConfig`-side `lora=hf_accel.LoRAConfig(...)`): the hooks on
the model's projections, the adapters read in CPU memory, the resident slots, and what each step needs of them.

- Added: a request's `lora_request` is read (or found in memory) in the caller's thread (`check`), so a folder that
  cannot be served is the caller's ValueError; the engine's thread takes the weights when the request arrives
  (`hold`: read again if memory dropped them meanwhile, the request failing alone if that fails) and keeps them
  until it leaves (`forget`), so scheduling never reads a file.
- Scheduled: a sequence enters the running queue only with a pin on its adapter's slot (`acquire`, which places the
  adapter when it is not resident); preempted, finished or aborted, it lets go (`release`). The scheduler admits
  in order, so a request whose adapter finds every slot pinned waits, and so do those behind it.
- Run: `running(batch)` tells the projections' hooks each packed token's slot for the forward. Where the engine
  compiles its step (fp32 on the CPU, the kernel built, no mixture-of-experts), the hooks are in the graphs
  (`compiled`): every projection is hooked from the start and the slots and stacked weights are graph inputs.
- Prefix cache: an adapter request's blocks are keyed under its adapter (`Request.prefix_root`): never shared with
  the base or with another adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..kernels.custom_ops import lora_kernel
from ..lora.adapter_check import AdapterShapes
from ..lora.adapter_files import AdapterWeights
from ..lora.adapter_set import AdapterSet
from ..lora.config import LoRAConfig, LoRARequest
from ..lora.layers import StepAdapters, adaptable_projections, lora_projections
from ..lora.slots import AdapterSlots
from .scheduler import ScheduledBatch
from .sequence import Request, Sequence
from .spec_decode import SpeculativeConfig

# methods whose proposals never come from the target's own hidden states: verified by each request's own adapter,
# they stay lossless (EAGLE and Medusa heads read the target's hidden states, trained on the base's)
LORA_METHODS = ("ngram", "suffix", "draft")


class EngineAdapters:
    """LoRA adapters served over `model` under `config`'s limits; `compile`: the engine compiles its step (the
    hooks then go into the graphs where they can: `compiled`); `max_step_tokens`: the most tokens a step packs."""

    def __init__(self, model: nn.Module, config: LoRAConfig, compile: bool = False, max_step_tokens: int = 512):
        if not isinstance(config, LoRAConfig):
            raise TypeError(f"`lora` must be a hf_accel.LoRAConfig, got {type(config).__name__}")
        self.config = config
        self.dtype, self.device = model.dtype, next(model.parameters()).device
        self.compiled = compile and compilable(model)
        self.step = StepAdapters(max_step_tokens, self.device, self.compiled)
        linears = adaptable_projections(model)
        self.stacks, self.projections = lora_projections(linears, config.max_loras, config.max_lora_rank, self.step)
        projections = {name: (linear.in_features, linear.out_features) for name, linear in linears.items()}
        self.shapes = AdapterShapes(config, projections, self.dtype)  # what a caller in another process checks
        self.adapters = AdapterSet(config, projections, self.dtype)
        self.slots = AdapterSlots(self.projections, config.max_loras)
        self._held: dict[int, int] = {}  # seq_id -> lora_int_id it holds a pin on
        self._weights: dict[str, AdapterWeights] = {}  # request_id -> its adapter, while the request is here

    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        """What the hooks read that a compiled step must take as inputs: the slots buffer and the stacks' buffers."""
        return self.step.token_slots, self.stacks.a, self.stacks.b, self.stacks.ranks

    def check(self, request: LoRARequest) -> None:
        """Read `request`'s adapter (kept in memory for the engine); ValueError / TypeError if it cannot be
        served."""
        self.adapters.get(request)

    def remove(self, lora_int_id: int) -> None:
        """Drop an adapter from memory and from its slot unless a running sequence pins it (in the engine's
        thread); requests naming its id later read its folder again."""
        self.adapters.remove(lora_int_id)
        self.slots.evict(lora_int_id)

    def hold(self, request: Request) -> None:
        """Keep `request`'s adapter weights until `forget` (nothing for a base request); ValueError if its folder
        can no longer be read."""
        if request.lora_request is not None:
            self._weights[request.request_id] = self.adapters.get(request.lora_request)

    def forget(self, request: Request) -> None:
        self._weights.pop(request.request_id, None)

    def acquire(self, seq: Sequence) -> bool:
        """Pin `seq`'s adapter in a slot (True for a base request); False, changing nothing, when no slot is
        free."""
        request = seq.request.lora_request
        if request is None or seq.seq_id in self._held:
            return True
        if self.slots.acquire(request.lora_int_id, self._weights[seq.request.request_id]) is None:
            return False
        self._held[seq.seq_id] = request.lora_int_id
        return True

    def release(self, seq: Sequence) -> None:
        """Let go of `seq`'s pin, if it holds one."""
        lora_id = self._held.pop(seq.seq_id, None)
        if lora_id is not None:
            self.slots.release(lora_id)

    @contextlib.contextmanager
    def running(self, batch: ScheduledBatch) -> Iterator[None]:
        """The hooks know each packed token's slot while the step's forward runs (tokens in `batch.scheduled`
        order, `num_new` per sequence)."""
        token_slots: list[int] = []
        for scheduled in batch.scheduled:
            lora_id = self._held.get(scheduled.seq.seq_id)
            token_slots += [-1 if lora_id is None else self.slots.slot_of(lora_id)] * scheduled.num_new
        self.step.set(token_slots, self.slots.ranks)
        try:
            yield
        finally:
            self.step.clear()


def served_adapters(model: nn.Module, config: LoRAConfig, speculative: SpeculativeConfig | None,
                    compile: bool = False, max_step_tokens: int = 512) -> EngineAdapters:
    """The engine's adapters over `model`; ValueError for a speculative method that does not run with adapters
    (`LORA_METHODS` do: each request's candidates are verified by its own adapter's logits, so its output is its
    adapter's greedy output; a draft model drafts as the base)."""
    if speculative is not None and speculative.method not in LORA_METHODS:
        raise ValueError(f"`lora` works with the speculative methods {LORA_METHODS}, not {speculative.method!r}: "
                         "EAGLE and Medusa heads draft from the target's hidden states, which an adapter changes")
    return EngineAdapters(model, config, compile, max_step_tokens)


def compilable(model: nn.Module) -> bool:
    """Whether the LoRA hooks can go into a compiled step over `model`: fp32 on the CPU with the kernel built (the
    torch form depends on the step's adapters), and no mixture-of-experts (whose experts' rows are not the step's
    tokens, which only an eager step can check)."""
    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    device = next(model.parameters()).device
    return (model.dtype == torch.float32 and device.type == "cpu" and not experts
            and lora_kernel() is not None)
