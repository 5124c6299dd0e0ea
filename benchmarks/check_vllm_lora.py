"""vLLM serves the LoRA adapters `hf-accel export --lora-modules` exports as hf_accel's Engine does (issue 46, item 5).

Two adapters of the reference target: "docs", trained by `run_adapter_finetune` (what `hf-accel finetune
--adapter-only` runs: rank 8 on every projection, package READMEs), and "mlp", a random rank-16 rsLoRA adapter on the
MLP projections only. `export_vllm(lora_modules=...)` writes the base (bf16) with both under `loras/`. The same
held-out prompts, each under the base and each adapter, all in one batch, are then answered by:
- vLLM's CPU build (`LLM(enable_lora=True, max_loras=M, max_lora_rank=R)`, one `LoRARequest` per request, fp32, one
  thread; benchmarks/vllm_lora_worker.py in the peer venv of bench_vllm_peer.py), with M (3: a slot per adapter and
  an empty one), R and the adapter folders read from the export's `serve.sh` arguments; and again with M = 2, the
  control that shows why serve.sh keeps a slot empty (vLLM's CPU ops run base tokens with the last slot's adapter);
- hf_accel's Engine (`lora=LoRAConfig(max_loras=2)`) on the exported weights read back in fp32, the adapters from the
  export's `loras/`; and, as the reference, peft's `merge_and_unload` of each adapter with plain greedy `generate`.
Greedy, EOS ignored. Passes when every vLLM output (serve.sh's flags) equals the Engine's, the Engine's equal peft's,
and each adapter changes some output (so an adapter vLLM silently ignored would fail).

    .venv/bin/python benchmarks/check_vllm_lora.py [--vllm-venv PATH] [--prompts 8] [--tokens 48] [--out DIR]

Writes benchmarks/results/check_vllm_lora.json and docs/check_vllm_lora.md; skips (exit 0, a message) without the
peer venv (`bench_vllm_peer.py --setup` creates it). Not in CI.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams, reference
from hf_accel.bench.output import hardware
from hf_accel.bench.peer import run_check, run_job
from hf_accel.export import export_vllm
from hf_accel.training.finetune import FinetuneConfig
from hf_accel.training.finetune_adapter import run_adapter_finetune
from hf_accel.training.finetune_domain import domain_splits
from hf_accel.training.lora import LoraSettings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vllm_peer import DEFAULT_VENV, side_env  # noqa: E402

NAME = "check_vllm_lora"
COMMAND = ".venv/bin/python benchmarks/check_vllm_lora.py"
WORKER = ROOT / "benchmarks" / "vllm_lora_worker.py"
PROMPT_LEN = 32
MAX_MODEL_LEN = 512
MLP = ("gate_proj", "up_proj", "down_proj")


def make_adapters(folder: Path, lora_steps: int) -> dict[str, dict[str, Any]]:
    """The two adapters (name -> folder and a description), written under `folder`."""
    model, tokenizer = reference.load("target")
    settings = LoraSettings(rank=8, alpha=16, steps=lora_steps, batch_size=4)
    trained = run_adapter_finetune(model, tokenizer, domain_splits(), folder / "docs",
                                   FinetuneConfig(seq_len=128, eval_rows=8, lora=settings), progress=False)
    model, _ = reference.load("target")
    torch.manual_seed(0)
    mlp = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=list(MLP), use_rslora=True,
                                           init_lora_weights=False))
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)  # a visible change of the outputs, not a different model
    mlp.save_pretrained(folder / "mlp")
    perplexity = trained["perplexity"]["finetuned"]["domain"]
    return {"docs": {"path": folder / "docs", "about": f"rank 8, every projection, {lora_steps} LoRA steps on "
                                                        f"package READMEs (held-out perplexity "
                                                        f"{trained['perplexity']['base']['domain']} -> {perplexity})"},
            "mlp": {"path": folder / "mlp", "about": "rank 16 rsLoRA on the MLP projections, random"}}


def serve_arguments(export: Path) -> dict[str, Any]:
    """`--max-lora-rank`, `--max-loras` and the `--lora-modules` folders of the export's `serve.sh` command."""
    from hf_accel.export.vllm_lora import LORA_SUBDIR

    adapters = {path.name: str(path) for path in sorted((export / LORA_SUBDIR).iterdir())}
    script = (export / "serve.sh").read_text()
    argv = script.split("exec ", 1)[1].split()
    return {"max_lora_rank": int(argv[argv.index("--max-lora-rank") + 1]),
            "max_loras": int(argv[argv.index("--max-loras") + 1]), "adapters": adapters}


def hf_accel_side(export: Path, adapters: dict[str, str], jobs: list[tuple[list[int], str | None]], tokens: int,
                  max_lora_rank: int) -> dict[str, list[list[int]]]:
    """The Engine's outputs and peft's merged-model outputs for `jobs` (prompt, adapter name or None)."""
    base = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    requests = {name: LoRARequest(name, lora_id, path) for lora_id, (name, path) in enumerate(adapters.items(), 1)}
    engine = Engine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=len(jobs), max_model_len=MAX_MODEL_LEN),
                    lora=LoRAConfig(max_loras=len(adapters), max_lora_rank=max_lora_rank))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    served = engine.generate([prompt for prompt, _ in jobs], params,
                             lora_request=[None if name is None else requests[name] for _, name in jobs])
    merged = {None: base} | {name: PeftModel.from_pretrained(copy.deepcopy(base), path).merge_and_unload().eval()
                             for name, path in adapters.items()}
    options = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "eos_token_id": None}
    reference_outputs = [merged[name].generate(torch.tensor([prompt]), **options)[0, len(prompt):].tolist()
                         for prompt, name in jobs]
    return {"engine": [out.outputs[0].token_ids for out in served], "peft": reference_outputs}


def vllm_side(python: Path, export: Path, served: dict[str, Any], jobs: list[tuple[list[int], str | None]],
              tokens: int, scratch: Path) -> dict[str, Any]:
    job = {"model": str(export), "max_model_len": MAX_MODEL_LEN, "max_loras": served["max_loras"],
           "max_lora_rank": served["max_lora_rank"],
           "adapters": {name: [lora_id, path] for lora_id, (name, path) in enumerate(served["adapters"].items(), 1)},
           "requests": [[prompt, tokens, name] for prompt, name in jobs]}
    return run_job([str(python), str(WORKER)], job, side_env("vllm"), scratch, 1800.0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def measure(args: argparse.Namespace, python: Path, scratch: Path) -> dict[str, Any]:
    made = make_adapters(scratch / "adapters", args.lora_steps)
    export = export_vllm(scratch / "export", served_model_name="reference-target",
                         lora_modules={name: adapter["path"] for name, adapter in made.items()})
    served = serve_arguments(export)
    _, tokenizer = reference.load("target")
    prompts = [row.tolist() for row in reference.held_out_sequences(tokenizer, PROMPT_LEN, args.prompts)]
    jobs = [(prompt, name) for prompt in prompts for name in (None, *served["adapters"])]  # mixed in one batch
    ours = hf_accel_side(export, served["adapters"], jobs, args.tokens, served["max_lora_rank"])
    theirs = vllm_side(python, export, served, jobs, args.tokens, scratch / "vllm")
    full = vllm_side(python, export, served | {"max_loras": len(served["adapters"])}, jobs, args.tokens,
                     scratch / "vllm-full")
    models = {}
    for name in (None, *served["adapters"]):
        rows = [i for i, (_, job_name) in enumerate(jobs) if job_name == name]
        base_rows = [i for i, (_, job_name) in enumerate(jobs) if job_name is None]
        gaps = [first_difference(theirs["outputs"][i], ours["engine"][i]) for i in rows]
        models["base" if name is None else name] = {
            "about": "the exported base" if name is None else made[name]["about"],
            "engine_equal_to_peft": sum(ours["engine"][i] == ours["peft"][i] for i in rows),
            "vllm_equal_to_engine": sum(gap is None for gap in gaps),
            "first_differences": [gap for gap in gaps if gap is not None],
            "differs_from_base": None if name is None else sum(
                theirs["outputs"][i] != theirs["outputs"][b] for i, b in zip(rows, base_rows)),
            "vllm_every_slot_used_equal_to_engine": sum(full["outputs"][i] == ours["engine"][i] for i in rows),
        }
    report = {"prompts": len(prompts), "prompt_len": PROMPT_LEN, "new_tokens": args.tokens,
              "serve_flags": {"max_lora_rank": served["max_lora_rank"], "max_loras": served["max_loras"]},
              "models": models, "vllm_load_seconds": round(theirs["load_seconds"], 1), "versions": theirs["versions"],
              "hardware": hardware()}
    report["passed"] = all(m["engine_equal_to_peft"] == len(prompts) and m["vllm_equal_to_engine"] == len(prompts)
                           and (m["differs_from_base"] is None or m["differs_from_base"] > 0)
                           for m in models.values())
    return report


def render(report: dict[str, Any]) -> str:
    n = report["prompts"]
    flags = report["serve_flags"]
    lines = [f"# vLLM check of exported LoRA adapters ({'passed' if report['passed'] else 'FAILED'})", "",
             f"Reference target exported by `hf_accel.export.export_vllm(lora_modules=...)` (bf16 base, two adapters "
             f"under `loras/`; serve.sh: `--max-lora-rank {flags['max_lora_rank']} --max-loras {flags['max_loras']}`), "
             f"run in fp32 on {n} held-out prompts of {report['prompt_len']} tokens, each under the base and each "
             f"adapter in one batch, {report['new_tokens']} greedy tokens (EOS ignored). vLLM "
             f"{report['versions']['vllm']} CPU build. From `{COMMAND}`.", "",
             "| model | adapter | hf_accel Engine = peft merged | vLLM = hf_accel Engine | vLLM output differs from "
             f"the base's | control: vLLM with --max-loras {flags['max_loras'] - 1} = hf_accel Engine |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, model in report["models"].items():
        differs = "-" if model["differs_from_base"] is None else f"{model['differs_from_base']}/{n}"
        gaps = f" (first difference at token {', '.join(map(str, model['first_differences']))})" \
            if model["first_differences"] else ""
        lines.append(f"| `{name}` | {model['about']} | {model['engine_equal_to_peft']}/{n} | "
                     f"{model['vllm_equal_to_engine']}/{n}{gaps} | {differs} | "
                     f"{model['vllm_every_slot_used_equal_to_engine']}/{n} |")
    lines += ["", f"serve.sh's `--max-loras {flags['max_loras']}` keeps the last slot empty. The control fills every "
              "slot: vLLM 0.32's CPU LoRA ops index the stacked adapters with a base token's -1, the last slot, so "
              "base requests batched with adapter requests run with whichever adapter sits there."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--lora-steps", type=int, default=16, help="the trained adapter's LoRA steps (4 rows each)")
    parser.add_argument("--out", type=Path, default=None, help="results root (default: the repository)")
    args = parser.parse_args(argv)
    return run_check(args.vllm_venv, NAME, args.out or ROOT, lambda python, scratch: measure(args, python, scratch),
                     render)


if __name__ == "__main__":
    sys.exit(main())
