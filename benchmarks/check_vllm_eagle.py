"""vLLM loads an exported EAGLE head and drafts with it what `eagle_generate` drafts (issue 26: the vLLM load check).

`hf_accel.export.export_vllm` writes the reference target and its EAGLE head (bf16, the head under `eagle3/` as vLLM's
EAGLE-3 draft). The same held-out prompts (64 tokens, greedy, EOS ignored) are then answered by:
- vLLM's CPU build (`speculative_config={"method": "eagle3", "model": OUT/eagle3, "num_speculative_tokens": K}`, fp32,
  one thread; benchmarks/vllm_peer_worker.py in the peer venv of bench_vllm_peer.py);
- `eagle_generate` on the exported weights read back in fp32 (the head's tensors loaded under their vLLM names),
  chains fixed at K like vLLM's (no adaptive length, no confidence cut), batch 1.
Both sides must give plain greedy output; their acceptance by draft position (accepted / drafting rounds) must agree
within `--tolerance`. Loading alone proves nothing: vLLM's `Eagle3LlamaForCausalLM.load_weights` reports no missing
tensor, so a control export without `fc.weight` is run too, and its acceptance must collapse.

    .venv/bin/python benchmarks/check_vllm_eagle.py [--vllm-venv PATH] [--eagle HEAD] [--prompts 8] [--tokens 96] [--out DIR]

Writes benchmarks/results/check_vllm_eagle.json and docs/check_vllm_eagle.md; skips (exit 0, a message) without
the peer venv (`bench_vllm_peer.py --setup` creates it). Not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_accel
from hf_accel import reference
from hf_accel.bench.output import hardware
from hf_accel.bench.peer import run_check, run_job
from hf_accel.export import export_vllm
from hf_accel.speculative.draft_length import DraftLength

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vllm_peer import DEFAULT_VENV, WORKER, side_env  # noqa: E402

NAME = "check_vllm_eagle"
COMMAND = ".venv/bin/python benchmarks/check_vllm_eagle.py"
PROMPT_LEN = 64


def prompts(num: int) -> list[list[int]]:
    """The first `num` rows of the held-out code shipped with the package, `PROMPT_LEN` tokens each."""
    _, tokenizer = reference.load("target")
    rows = reference.held_out_sequences(tokenizer, seq_len=PROMPT_LEN, max_rows=num)
    return [row.tolist() for row in rows]


def without_fc(export: Path, control: Path) -> Path:
    """A copy of `export`'s model files with the EAGLE head's `fc.weight` left out (the control)."""
    control.mkdir(parents=True)
    for item in export.iterdir():
        if item.is_file():
            (control / item.name).write_bytes(item.read_bytes())
    (control / "eagle3").mkdir()
    (control / "eagle3" / "config.json").write_bytes((export / "eagle3" / "config.json").read_bytes())
    tensors = load_file(export / "eagle3" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, control / "eagle3" / "model.safetensors")
    return control


def vllm_side(python: Path, folder: Path, requests: list[list[int]], tokens: int, k: int, scratch: Path) -> dict:
    job = {"side": "vllm", "model": str(folder), "max_model_len": 512, "max_num_seqs": 1,
           "max_num_batched_tokens": None, "requests": [[prompt, tokens] for prompt in requests], "warmup": 1,
           "sequential": False,
           "speculative": {"method": "eagle3", "model": str(folder / "eagle3"), "num_speculative_tokens": k}}
    return run_job([str(python), str(WORKER)], job, side_env("vllm"), scratch, 1800.0)


@contextlib.contextmanager
def fixed_chains():
    """`eagle_generate` keeps its first draft length (vLLM drafts fixed chains of K)."""
    update = DraftLength.update
    DraftLength.update = lambda self, k, fewest_accepted: None
    try:
        yield
    finally:
        DraftLength.update = update


def hf_accel_side(folder: Path, requests: list[list[int]], tokens: int, k: int) -> dict[str, Any]:
    """Plain greedy and `eagle_generate` (chains of `k`) over `requests`, one at a time, on the exported weights."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    head = hf_accel.EagleHead.for_model(model)
    head.load_state_dict(load_file(folder / "eagle3" / "model.safetensors"))  # vLLM's names are the head's own
    head = head.float().eval()
    stats, plain, eagle = hf_accel.SpeculativeStats(), [], []
    options = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}
    for prompt in requests:
        ids = torch.tensor([prompt])
        plain.append(model.generate(ids, **options)[0, len(prompt):].tolist())
        with fixed_chains():
            out = model.generate(ids, **options, custom_generate=hf_accel.eagle_generate, eagle_head=head,
                                 num_draft_tokens=k, max_draft_tokens=k, min_draft_probability=0.0,
                                 eagle_stats=stats)
        eagle.append(out[0, len(prompt):].tolist())
    return {"plain": plain, "outputs": eagle, "rounds": stats.num_row_rounds,
            "accepted_per_pos": [a for a in stats.accepted[:k]] + [0] * (k - len(stats.accepted[:k]))}


def rates(accepted: list[int], rounds: int) -> list[float]:
    """P(draft position j accepted) per drafting round, j = 0..K-1."""
    return [round(a / rounds, 4) if rounds else 0.0 for a in accepted]


def vllm_rates(result: dict[str, Any]) -> tuple[list[float], int]:
    spec = result["spec_decode"]
    return rates(spec["num_accepted_tokens_per_pos"], spec["num_drafts"]), spec["num_drafts"]


def measure(args: argparse.Namespace, python: Path, scratch: Path) -> dict[str, Any]:
    export = export_vllm(scratch / "export", eagle=args.eagle, served_model_name="reference-target")
    requests = prompts(args.prompts)
    ours = hf_accel_side(export, requests, args.tokens, args.k)
    theirs = vllm_side(python, export, requests, args.tokens, args.k, scratch / "vllm")
    control = vllm_side(python, without_fc(export, scratch / "control"), requests, args.tokens, args.k,
                        scratch / "vllm-control")
    our_rates = rates(ours["accepted_per_pos"], ours["rounds"])
    their_rates, their_drafts = vllm_rates(theirs)
    control_rates, control_drafts = vllm_rates(control)
    gap = max(abs(a - b) for a, b in zip(our_rates, their_rates))
    report = {
        "prompts": len(requests), "prompt_len": PROMPT_LEN, "new_tokens": args.tokens, "num_speculative_tokens": args.k,
        "hf_accel": {"acceptance_by_position": our_rates, "drafting_rounds": ours["rounds"],
                     "mean_accepted": round(sum(our_rates), 3),
                     "identical_to_plain": sum(a == b for a, b in zip(ours["outputs"], ours["plain"]))},
        "vllm": {"acceptance_by_position": their_rates, "drafting_rounds": their_drafts,
                 "mean_accepted": round(sum(their_rates), 3),
                 "identical_to_plain": sum(a == b for a, b in zip(theirs["outputs"], ours["plain"])),
                 "load_seconds": round(theirs["load_seconds"], 1), "versions": theirs["versions"]},
        "vllm_without_fc": {"acceptance_by_position": control_rates, "drafting_rounds": control_drafts,
                            "mean_accepted": round(sum(control_rates), 3)},
        "max_position_gap": round(gap, 4), "tolerance": args.tolerance, "hardware": hardware(),
    }
    report["passed"] = (gap <= args.tolerance and report["hf_accel"]["identical_to_plain"] == len(requests)
                        and report["vllm"]["identical_to_plain"] == len(requests)
                        and sum(control_rates) < 0.25 * sum(their_rates))
    return report


def render(report: dict[str, Any]) -> str:
    k = report["num_speculative_tokens"]
    lines = [f"# vLLM load check of the exported EAGLE head ({'passed' if report['passed'] else 'FAILED'})", "",
             f"Reference target + its EAGLE head exported by `hf_accel.export.export_vllm` (bf16), run in fp32 on "
             f"{report['prompts']} held-out prompts of {report['prompt_len']} tokens, {report['new_tokens']} greedy "
             f"tokens each (EOS ignored), batch 1, chains of {k} drafts on both sides. From `{COMMAND}`.", "",
             "| side | acceptance by draft position (accepted / rounds) | accepted per round | rounds | "
             "outputs equal to plain greedy |", "| --- | --- | --- | --- | --- |"]
    for name, key in (("hf_accel `eagle_generate`", "hf_accel"), ("vLLM 0.32 CPU, `method: eagle3`", "vllm"),
                      ("vLLM, control export without `fc.weight`", "vllm_without_fc")):
        side = report[key]
        identical = side.get("identical_to_plain")
        equal = "-" if identical is None else f"{identical}/{report['prompts']}"
        by_position = " ".join(f"{r:.2f}" for r in side["acceptance_by_position"])
        lines.append(f"| {name} | {by_position} | {side['mean_accepted']:.2f} | {side['drafting_rounds']} | {equal} |")
    lines += ["", f"Largest gap between the two sides at one position: {report['max_position_gap']:.3f} "
              f"(tolerance {report['tolerance']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--eagle", type=Path, default=None, help="EAGLE head folder (default: the reference head)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=5, help="num_speculative_tokens (both sides)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest allowed per-position gap")
    parser.add_argument("--out", type=Path, default=None, help="results root (default: the repository)")
    args = parser.parse_args(argv)
    return run_check(args.vllm_venv, NAME, args.out or ROOT, lambda python, scratch: measure(args, python, scratch),
                     render)


if __name__ == "__main__":
    sys.exit(main())
