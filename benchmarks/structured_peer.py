"""bench_structured.py's vLLM rows: the engine and vLLM's CPU build (its venv, as bench_vllm_peer.py) on the same
16 constrained requests, each side in its own process, on the reference target and on bench_size.py's 185M
random-weight Llama: tok/s, validity, identical greedy outputs; skipped with a message without the venv or with
--quick."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from structured_schemas import MAX_TOKENS, SCHEMAS, check, prompts_for, tally


def vllm_side_by_side(model, tokenizer, plan: dict[str, Any]) -> dict[str, Any]:
    """The engine and vLLM's CPU build on the same constrained requests, on the reference target."""
    peer = peer_python(plan)
    if isinstance(peer, str):
        return {"skipped": peer}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return side_by_side(folder, tokenizer, peer, Path(scratch))


def vllm_side_by_side_185m(model, tokenizer, plan: dict[str, Any]) -> dict[str, Any]:
    """The same at a real size: bench_size.py's 185M-parameter random-weight Llama (the reference tokenizer)."""
    import bench_size

    peer = peer_python(plan)
    if isinstance(peer, str):
        return {"skipped": peer}
    size = next(size for size in bench_size.FULL.sizes if size.name == "185M")
    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_size.model_folder(size, Path(scratch) / "model")
        return side_by_side(folder, tokenizer, peer, Path(scratch))


def peer_python(plan: dict[str, Any]) -> Path | str:
    """vLLM's python, or why its rows are skipped."""
    from bench_vllm_peer import DEFAULT_VENV
    from hf_accel.bench.peer import venv_python

    peer = venv_python(DEFAULT_VENV, "vllm")
    if peer is None:
        return f"no vLLM venv at {DEFAULT_VENV} (bench_vllm_peer.py --setup creates it)"
    return peer if plan["peer"] else "--quick"


def side_by_side(folder: Path, tokenizer, peer: Path, scratch: Path) -> dict[str, Any]:
    """16 constrained requests (two per schema) answered by each side in its own process from `folder`."""
    from hf_accel.bench.peer import run_job

    jobs = prompts_for(tokenizer, 16)
    requests = [[tokenizer(prompt, add_special_tokens=False)["input_ids"], MAX_TOKENS] for _, prompt in jobs]
    schemas = [SCHEMAS[name]["schema"] for name, _ in jobs]
    results = {}
    for side, python in (("hf_accel", Path(sys.executable)), ("vllm", peer)):
        job = {"side": side, "model": str(folder), "max_model_len": 512, "max_num_seqs": 16,
               "max_num_batched_tokens": None, "requests": requests, "warmup": 2, "sequential": False,
               "json_schemas": schemas}
        worker = [str(python), str(Path(__file__).resolve().parent / "vllm_peer_worker.py")]
        results[side] = run_job(worker, job, side_env(side), scratch / side, timeout=1800)
    summary = {}
    for side, result in results.items():
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in result["outputs"]]
        finished = [tokenizer.eos_token_id in ids or len(ids) < MAX_TOKENS for ids in result["outputs"]]
        verdicts = [check(name, text, "stop" if done else "length")
                    for (name, _), text, done in zip(jobs, texts, finished)]
        tokens = sum(len(ids) for ids in result["outputs"])
        summary[side] = {"tok_s": tokens / result["seconds"], "seconds": result["seconds"], "tokens": tokens,
                         **tally(verdicts)}
    identical = sum(a == b for a, b in zip(results["hf_accel"]["outputs"], results["vllm"]["outputs"]))
    return {"requests": len(jobs), "sides": summary, "identical": identical,
            "ratio": summary["hf_accel"]["tok_s"] / summary["vllm"]["tok_s"]}


def side_env(side: str) -> dict[str, str]:
    from bench_vllm_peer import side_env as peer_env

    return peer_env(side)


def peer_lines(peer: dict[str, Any], where: str) -> list[str]:
    if "skipped" in peer:
        return [f"vLLM side by side on {where}: skipped ({peer['skipped']}).", ""]
    lines = [f"## Against vLLM's CPU build, {where} ({peer['requests']} constrained requests, greedy)", "",
             "| side | tok/s | valid | invalid | cut by max_tokens |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {side} | {s['tok_s']:.0f} | {s['valid']} | {s['invalid']} | {s['unfinished']} |"
              for side, s in peer["sides"].items()]
    return lines + ["", f"hf_accel / vLLM: {peer['ratio']:.2f}x; identical greedy outputs: {peer['identical']} of "
                        f"{peer['requests']}. Both on xgrammar without free whitespace, but vLLM's grammar writes "
                        "compact separators (`,` `:`) where hf_accel's writes `, ` and `: ` (as `json.dumps` and the "
                        "prompts' examples do), so greedy outputs part at the first separator.", ""]
