"""Benchmarks of generation strategies, shared by `hf-accel bench` and the scripts under benchmarks/.

    models      what a benchmark runs on (`BenchModel`: the reference target and draft, or any causal LM)
    inputs      left-padded prompts: held-out text or random ids
    strategies  the rows compared (`Strategy`, `STRATEGIES`, `strategies_for`)
    timing      same-process interleaved timing (`compare_strategies`; its rules are in that module's docstring)
    results     what a row measured (`StrategyResult`, K/V bytes, agreement) and its table
    output      a benchmark script's command line, machine description and result files
    command     `hf-accel bench`
"""

from .inputs import copy_heavy_prompts, make_prompts, prompt_lengths, text_prompts
from .models import RANDOM_MODEL_NOTE, BenchModel, describe_model, load_bench_model, random_llama
from .output import hardware
from .results import StrategyResult, block_waste, kv_bytes, results_table, token_agreement
from .strategies import STRATEGIES, Strategy, quantized_int4, strategies_for, weight_quantized
from .timing import compare_strategies, count_forwards, run_generate, torch_threads

__all__ = [
    "RANDOM_MODEL_NOTE", "STRATEGIES", "BenchModel", "Strategy", "StrategyResult", "block_waste", "compare_strategies",
    "copy_heavy_prompts", "count_forwards", "describe_model", "hardware", "kv_bytes", "load_bench_model",
    "make_prompts", "prompt_lengths", "quantized_int4",
    "random_llama", "results_table", "run_generate", "strategies_for", "text_prompts", "token_agreement",
    "torch_threads", "weight_quantized",
]
