"""`EngineStats`: the engine's counters and gauges at one moment, named after vLLM's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    """Counters since start and current gauges, named after vLLM's metrics."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    num_free_blocks: int
    num_blocks: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    compile_seconds: float = 0.0  # compiling the model step at start; 0 when eager
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [j]: candidate j accepted
    compiling: bool = False  # the model step's graphs compile in the background; steps run eagerly meanwhile
    jump_forward_tokens: int = 0  # candidates constrained sequences' grammars forced (counted in the spec_decode ones)
    max_loras: int = 0  # adapters resident at once (0: the engine serves no LoRA adapters)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)  # adapter name -> its running requests
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)  # adapter name -> its waiting requests
