"""Many LoRA adapters over one base model, served unmerged and chosen per request (vLLM's `--enable-lora` shape):
`LoRAConfig` / `LoRARequest` (`config.py`), peft adapter folders read and checked against the base
(`adapter_files.py`), the adapters kept in CPU memory (`adapter_set.py`), the resident ones stacked per projection
(`slots.py`), and the batched LoRA update added to each projection's output for a batch that mixes adapters
(`layers.py`). The engine's side is `engine/lora_requests.py`."""
