"""One side of benchmarks/bench_vllm_peer.py in its own process: answer a job's requests with hf_accel's Engine
(run by the project's python) or vLLM's `LLM` (run by the peer venv's python, which has no hf_accel).

    python benchmarks/vllm_peer_worker.py JOB.json RESULT.json

JOB: {"side": "hf_accel" | "vllm", "model": folder, "max_model_len", "max_num_seqs", "max_num_batched_tokens"
(null: the engine's default), "requests": [[prompt token ids, max_tokens], ...], "warmup": n, "sequential": bool,
optional "speculative": a vLLM `speculative_config` dict (vLLM only), optional "json_schemas": one JSON schema per
request (both sides)}.
Each request is greedy and generates exactly its max_tokens (EOS ignored); with "json_schemas", its output is
constrained to its schema (xgrammar, no free whitespace) and ends at EOS once the schema is complete. The first
`warmup` requests run once untimed, then all requests are timed as one batch call. RESULT: {"side", "seconds" (the
timed call), "load_seconds", "outputs" (generated token ids per request), "threads", "versions"} and, with
"sequential" (hf_accel only),
"sequential_outputs" (one greedy `generate` per request: the reference) and "sequential_seconds"; with
"speculative", "spec_decode": vLLM's counters over the timed call (drafts, draft tokens, accepted tokens, accepted
per draft position).
One compute thread: hf_accel sets torch's threads to 1 here; vLLM's worker takes it from VLLM_CPU_OMP_THREADS_BIND,
which the parent sets.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def engine_limits(job: dict[str, Any]) -> dict[str, int]:
    """The job's `max_num_seqs` and `max_num_batched_tokens` that are set (null: the engine's own default)."""
    return {key: job[key] for key in ("max_num_seqs", "max_num_batched_tokens") if job[key] is not None}


def run_hf_accel(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_accel
    from hf_accel.bench.workload import Request, engine_outputs, sequential_outputs

    if job.get("json_schemas"):
        return run_hf_accel_structured(job)

    torch.set_num_threads(1)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    config = hf_accel.EngineConfig(max_model_len=job["max_model_len"], **engine_limits(job))
    engine = hf_accel.Engine(model, AutoTokenizer.from_pretrained(job["model"]), config=config)
    work = [Request(prompt, max_tokens) for prompt, max_tokens in job["requests"]]
    load_seconds = time.perf_counter() - started
    engine_outputs(engine, work[: job["warmup"]])
    started = time.perf_counter()
    outputs = engine_outputs(engine, work)
    result = {"seconds": time.perf_counter() - started, "load_seconds": load_seconds, "outputs": outputs,
              "threads": torch.get_num_threads(),
              "versions": {"hf_accel": hf_accel.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    if job["sequential"]:
        started = time.perf_counter()
        result["sequential_outputs"] = sequential_outputs(model, work)
        result["sequential_seconds"] = time.perf_counter() - started
    return result


def run_hf_accel_structured(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_accel

    torch.set_num_threads(1)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    config = hf_accel.EngineConfig(max_model_len=job["max_model_len"], **engine_limits(job))
    engine = hf_accel.Engine(model, AutoTokenizer.from_pretrained(job["model"]), config=config)
    prompts = [prompt for prompt, _ in job["requests"]]
    params = [hf_accel.SamplingParams(max_tokens=n, temperature=0,
                                      structured_outputs=hf_accel.StructuredOutputsParams(json=schema))
              for (_, n), schema in zip(job["requests"], job["json_schemas"])]
    load_seconds = time.perf_counter() - started
    engine.generate(prompts[: job["warmup"]], params[: job["warmup"]])
    started = time.perf_counter()
    outputs = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
    return {"seconds": time.perf_counter() - started, "load_seconds": load_seconds, "outputs": outputs,
            "threads": torch.get_num_threads(), "versions": {"hf_accel": hf_accel.__version__}}


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    import vllm
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    speculative = job.get("speculative")
    structured = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}} \
        if job.get("json_schemas") else {}  # the engine-wide setting (the request's own was not applied)
    llm = vllm.LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
                   speculative_config=speculative, disable_log_stats=speculative is None, **engine_limits(job),
                   **structured)
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in job["requests"]]
    if job.get("json_schemas"):
        from vllm.sampling_params import StructuredOutputsParams

        params = [vllm.SamplingParams(max_tokens=n, temperature=0, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True)) for (_, n), schema in zip(job["requests"], job["json_schemas"])]
    else:
        params = [vllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in job["requests"]]
    load_seconds = time.perf_counter() - started
    llm.generate(prompts[: job["warmup"]], params[: job["warmup"]], use_tqdm=False)
    before = spec_decode_counters(llm) if speculative else None
    started = time.perf_counter()
    answers = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    counted = {} if before is None else {"spec_decode": counter_delta(before, spec_decode_counters(llm))}
    return {**counted, "seconds": seconds, "load_seconds": load_seconds,
            "outputs": [list(answer.outputs[0].token_ids) for answer in answers],
            "threads": None,  # vLLM's compute runs in its worker process: see VLLM_CPU_OMP_THREADS_BIND
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__}}


def spec_decode_counters(llm) -> dict[str, Any]:
    """vLLM's speculative-decoding counters so far: drafts, draft tokens, accepted tokens, accepted per position."""
    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            found[name] = found.get(name, 0) + metric.value
        elif name == "num_accepted_tokens_per_pos":
            found[name] = [a + b for a, b in zip(found.get(name, [0] * len(metric.values)), metric.values)]
    return found


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after - before`, per counter (elementwise for the per-position list)."""
    return {key: [a - b for a, b in zip(value, before.get(key, [0] * len(value)))] if isinstance(value, list)
            else value - before.get(key, 0) for key, value in after.items()}


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    if job["side"] not in ("hf_accel", "vllm"):
        raise ValueError(f"side must be 'hf_accel' or 'vllm', got {job['side']!r}")
    result = run_hf_accel(job) if job["side"] == "hf_accel" else run_vllm(job)
    with open(result_path, "w") as f:
        json.dump({"side": job["side"], **result}, f)


if __name__ == "__main__":  # vLLM spawns its engine processes: nothing may run on import
    main(*sys.argv[1:3])
