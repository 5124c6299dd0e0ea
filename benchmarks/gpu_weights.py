"""gpu_check's `weights` section: hf_accel's weight-only int8 / int4 on the device at ~1B parameters, against bf16.

A random-weight Llama of TinyLlama's shape (1.1B parameters; built from a config on the device, never saved) in bf16,
and `quantize_model` copies of it in hf_accel int8 (per channel) and int4 (groups of 64), whose Linears take the
device's kernels (CUDA: torch's `_weight_int4pack_mm` for int4, a plain-torch int8 product). For each format: the
weight bytes a decode step reads, the last position's logits against bf16's (cosine: random weights have no text to
score), and greedy `generate` at batch 1, eager `DynamicCache` against compiled paged (`compile_config`): identical
tokens, first-call seconds, milliseconds per token, and the read rate that gives (bytes a token x tokens a second).
`--quick` builds a 2-layer model instead (the CPU check of the script itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from bench_size import bytes_read_per_token  # the kernels' layouts, as a decode step reads them
from hf_accel import Int4Linear, Int8Linear, WeightOnlyConfig, quantize_model
from hf_accel.display import format_bytes

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000)  # TinyLlama's: 1.1B parameters
QUICK_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
FORMATS = {"bf16": None, "int8": WeightOnlyConfig(bits=8), "int4": WeightOnlyConfig(bits=4)}
PROMPT_TOKENS = 32


def random_llama(device: torch.device, quick: bool) -> LlamaForCausalLM:
    """The bf16 model every format is made from (seeded: the same weights each run)."""
    torch.manual_seed(0)
    config = LlamaConfig(**(QUICK_SHAPE if quick else SHAPE), tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=None, bos_token_id=1)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    return model


def check_weights(device: torch.device, quick: bool, compare_sides: Callable[..., dict[str, Any]],
                  compile_config: Callable[[], CompileConfig]) -> dict[str, Any]:
    """Each format's bytes, logits cosine against bf16 and eager / compiled generate (gpu_check's `compare_sides`
    with its `compile_config`)."""
    base = random_llama(device, quick)
    prompt = torch.randint(1, base.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = base(prompt.to(device)).logits[0, -1].float()
    sides = {"dynamic": {}, "paged + compile": {"cache_implementation": "paged", "compile_config": compile_config()}}
    result: dict[str, Any] = {"parameters": sum(p.numel() for p in base.parameters()), "formats": {}}
    for name, config in FORMATS.items():
        model = base if config is None else quantize_model(base, config, progress=False)
        with torch.no_grad():
            logits = model(prompt.to(device)).logits[0, -1].float()
        generate = compare_sides(model, prompt, 8 if quick else 64, device, sides)
        per_token_s = generate["ms_per_token"].get("paged + compile", 0) / 1e3
        nbytes = bytes_read_per_token(model)
        result["formats"][name] = {
            "weight_bytes": nbytes, "layouts": sorted({m.layout or "torch" for m in model.modules()
                                                       if isinstance(m, (Int8Linear, Int4Linear))}),
            "logits_cosine": round(torch.nn.functional.cosine_similarity(logits, reference, dim=0).item(), 5),
            "generate": generate, "compiled_read_gb_s": round(nbytes / per_token_s / 1e9, 1) if per_token_s else None}
        del model  # the next format's copy is made without this one held (peak device memory)
    return result


def render(result: dict[str, Any]) -> list[str]:
    """The section's table (markdown lines)."""
    lines = [f"Weight-only quantization, a random Llama of {result['parameters'] / 1e9:.2f}B parameters (bf16 base), "
             "batch 1, greedy `generate`:", "",
             "| weights | kernel layout | bytes / token | logits cosine vs bf16 | eager = compiled | first call s "
             "(compiled) | ms per token (eager / compiled) | compiled read GB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in result["formats"].items():
        g, ms = f["generate"], f["generate"]["ms_per_token"]
        cells = " / ".join(f"{ms[side]:.2f}" if side in ms else "failed" for side in ("dynamic", "paged + compile"))
        first, rate = g["first_call_s"].get("paged + compile", "failed"), f["compiled_read_gb_s"] or "-"
        lines.append(f"| {name} | {', '.join(f['layouts']) or '-'} | {format_bytes(f['weight_bytes'])} | "
                     f"{f['logits_cosine']:.4f} | {g['identical']} | {first} | {cells} | {rate} |")
        lines += [f"| | {side} failed: {error} | | | | | | |" for side, error in g["errors"].items()]
    return lines + [""]
