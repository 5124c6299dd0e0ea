"""vLLM's side of benchmarks/check_vllm_lora.py, run by the peer venv's python (which has no hf_accel): greedy answers
of an exported base with LoRA adapters, each request with its own adapter or none.

    python benchmarks/vllm_lora_worker.py JOB.json RESULT.json

JOB: {"model": folder, "max_model_len", "max_loras", "max_lora_rank", "adapters": {name: [lora_int_id, folder]},
"requests": [[prompt token ids, max_tokens, adapter name or null], ...]}. Every request is greedy and generates
exactly its max_tokens (EOS ignored), all in one `LLM.generate` call. RESULT: {"outputs" (generated token ids per
request), "load_seconds", "seconds", "versions"}. One compute thread: vLLM's worker takes it from
VLLM_CPU_OMP_THREADS_BIND, which the parent sets.
With "runs": {label: requests} instead of "requests" (benchmarks/bench_lora.py), after "warmup" untimed calls of
each run, the runs are timed in turn "repeats" times: RESULT's "runs" is {label: {"seconds": [one per repeat],
"outputs"}}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    started = time.perf_counter()
    llm = vllm.LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
                   enable_lora=True, max_loras=job["max_loras"], max_lora_rank=job["max_lora_rank"])
    adapters = {name: LoRARequest(name, lora_id, path) for name, (lora_id, path) in job["adapters"].items()}
    load_seconds = time.perf_counter() - started
    versions = {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}

    def generate(requests: list) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _, _ in requests]
        params = [vllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n, _ in requests]
        loras = [None if name is None else adapters[name] for _, _, name in requests]
        started = time.perf_counter()
        answers = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - started, [list(answer.outputs[0].token_ids) for answer in answers]

    if "runs" not in job:
        seconds, outputs = generate(job["requests"])
        return {"outputs": outputs, "load_seconds": load_seconds, "seconds": seconds, "versions": versions}
    for _ in range(job.get("warmup", 1)):
        for requests in job["runs"].values():
            generate(requests)
    runs: dict[str, dict[str, Any]] = {label: {"seconds": []} for label in job["runs"]}
    for _ in range(job.get("repeats", 1)):
        for label, requests in job["runs"].items():
            seconds, runs[label]["outputs"] = generate(requests)
            runs[label]["seconds"].append(seconds)
    return {"runs": runs, "load_seconds": load_seconds, "versions": versions}


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
