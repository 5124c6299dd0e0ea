"""Costs the compiled-generate benchmark reports beside its rows: a compiled verify forward over a compiled decode
step (`verify_cost`, speculative decoding's price per round) and llama.cpp's decode speed on the same weights when a
local build is given (`llama_cpp_decode`, another process: not a paired ratio)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig, PreTrainedModel

from ..compiled.paged_rows import PagedRows
from ..compiled.step import compile_context, compiled_decode_step, compiled_tree_verify_step, compiled_verify_step
from ..runtime.attention import ATTENTION_NAME, gathered_attention
from ..runtime.cuda_graphs import decode_attention
from ..kernels.custom_ops import paged_attention_kernel, paged_tree_attention_kernel
from ..speculative.tree import DEFAULT_TREE, build_tree
from ..registry import attention_implementation
from .timing import time_interleaved


def verify_cost(model: PreTrainedModel, prompt_len: int, repeats: int) -> dict[str, float]:
    """Compiled verify forward of 1 + k tokens (k = 4, 8), and of a 9-node Medusa tree (`tree_9`, the first 8 paths
    of `DEFAULT_TREE`, through the paged tree attention), over one row's 256-token context, in milliseconds and as a
    multiple of a compiled decode step (target: <= 1.15x), interleaved, median of `repeats` x 20 calls."""
    rows = PagedRows(model, [prompt_len], prompt_len + 16, 16)
    attend = paged_attention_kernel() or gathered_attention
    config = CompileConfig()
    decode, verify = compiled_decode_step(config, model), compiled_verify_step(config, model)
    tree_verify, tree = compiled_tree_verify_step(config, model), build_tree(DEFAULT_TREE[:8], 4)
    prompt = torch.randint(1, model.config.vocab_size, (prompt_len,))
    position = torch.tensor([prompt_len])
    calls = {1: lambda: decode(model, prompt[:1], position, rows.kv, rows.block_table, attend, (), False, False)}
    for k in (4, 8):
        tokens = prompt[None, : k + 1]
        calls[k + 1] = lambda tokens=tokens: verify(model, tokens, position, rows.kv, rows.block_table, attend)
    tree_attend, mask = paged_tree_attention_kernel() or decode_attention, tree.ancestors[None]
    calls["tree 9"] = lambda: tree_verify(model, prompt[None, :9], position, tree.depths, mask, rows.kv,
                                          rows.block_table, tree_attend)
    with torch.inference_mode(), attention_implementation(model, ATTENTION_NAME), \
            compile_context(rows.device, config, model.dtype):
        inputs = rows.prefill([prompt], attend)
        # output_hidden_states eagerly first: transformers installs its capturing hooks then, outside any graph
        model(input_ids=inputs.tokens, position_ids=inputs.positions, use_cache=False, output_hidden_states=True,
              hf_accel_step=inputs.attention)

        def measure(num: int) -> tuple[float, None]:
            started = time.perf_counter()
            for _ in range(20):
                calls[num]()
            return (time.perf_counter() - started) / 20 * 1e3, None

        timings = time_interleaved(list(calls), measure, repeats)
    ms = {num: statistics.median(times) for num, times in timings.seconds.items()}
    return {"decode_ms": round(ms[1], 3), **{f"verify_{num}_ms": round(ms[num], 3) for num in (5, 9)},
            **{f"verify_{num}_over_decode": round(ms[num] / ms[1], 3) for num in (5, 9)},
            "tree_9_ms": round(ms["tree 9"], 3), "tree_9_over_decode": round(ms["tree 9"] / ms[1], 3)}


def llama_cpp_decode(new_tokens: int) -> dict[str, Any]:
    """llama.cpp's `llama-bench` decode speed on one thread, or why it was skipped."""
    binary = os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    gguf = os.environ.get("HF_ACCEL_LLAMA_GGUF")
    if binary is None or gguf is None or not Path(gguf).is_file():
        return {"skipped": "no local llama.cpp build and GGUF of the same weights (set LLAMA_BENCH to llama-bench "
                           "and HF_ACCEL_LLAMA_GGUF to the model file)"}
    out = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(new_tokens), "-t", "1", "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=600)
    runs = json.loads(out.stdout)
    return {"decode_tokens_per_s": float(runs[0]["avg_ts"]), "binary": binary, "gguf": gguf}
