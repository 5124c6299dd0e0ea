"""Medusa benchmark: greedy Medusa decoding against plain greedy generate on the reference target.

Prompts are held-out rows of the reference corpus (text the model and the heads never trained on). For each prompt
and repeat, plain `generate` and `generate(custom_generate=medusa_generate)` run back to back in the same process
(interleaved, one warm-up of each first); greedy outputs must be token-for-token equal. Reported: new tokens per
target forward (the prefill counted as one forward, as plain decoding makes one token per forward), acceptance per
tree depth, and the wall-time ratio plain / Medusa (median over prompts x repeats) for each tree, greedy; then the
heads' own tree with sampling (temperature 0.7, both sides seeded alike).

    .venv/bin/python benchmarks/bench_medusa.py              # writes benchmarks/results/bench_medusa.json
    .venv/bin/python benchmarks/bench_medusa.py --quick      # 2 prompts, 1 repeat, prints only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from hf_accel import reference
from hf_accel.speculative.medusa import MedusaStats, medusa_generate
from hf_accel.speculative.medusa_command import REFERENCE_HEADS_DIR
from hf_accel.speculative.medusa_heads import MedusaHeads
from hf_accel.speculative.tree import DEFAULT_TREE, sparse_tree

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_medusa.py"
GREEDY = {"do_sample": False}
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
def trees(heads_dir: Path) -> dict[str, list | None]:
    """The heads' own calibrated tree, sparse trees of other sizes from the same measured rank accuracies, the
    built-in default and a plain chain of top-1 candidates."""
    record = json.loads((heads_dir / "training.json").read_text())
    rates = torch.tensor(record["calibration"]["rank_accuracy_on_own_greedy_output"])
    size = record["calibration"]["tree_size"]
    return {
        f"calibrated, {size} candidates (the heads' default)": None,
        **{f"calibrated, {n} candidates": sparse_tree(rates, n) for n in (12, 64) if n != size},
        f"built-in default, {len(DEFAULT_TREE)} candidates": list(DEFAULT_TREE),
        "chain of top-1s, 4 candidates": [(0,) * depth for depth in range(1, 5)],
    }


def timed(fn) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def run_tree(model, heads, prompts: torch.Tensor, tree, new_tokens: int, repeats: int, sampling: dict | None = None
             ) -> dict:
    """Interleaved plain / Medusa runs over every prompt, each side seeded alike. Greedy outputs must be equal;
    with `sampling` (generate kwargs) the count of equal outputs is reported (equal seeds draw equal tokens up to
    float rounding of the wider verification forward)."""
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, **(sampling or {}))
    ratios, plain_times, medusa_times, stats, num_equal = [], [], [], MedusaStats(), 0
    for index in range(-1, prompts.shape[0]):  # index -1: warm-up on the first prompt, not recorded
        prompt = prompts[max(index, 0)][None]
        for repeat in range(1 if index < 0 else repeats):
            torch.manual_seed(repeat)
            plain_s, plain = timed(lambda: model.generate(prompt, **common))
            counted = MedusaStats() if index < 0 else stats
            torch.manual_seed(repeat)
            medusa_s, medusa = timed(lambda: model.generate(prompt, custom_generate=medusa_generate, medusa_heads=heads,
                                                            medusa_tree=tree, medusa_stats=counted, **common))
            assert sampling or torch.equal(plain, medusa), "Medusa greedy output differs from plain greedy"
            if index >= 0:
                ratios.append(plain_s / medusa_s)
                plain_times.append(plain_s)
                medusa_times.append(medusa_s)
                num_equal += int(torch.equal(plain, medusa))
    return {
        "tokens_per_forward": round(stats.tokens_per_step, 3),
        "accepted_per_step_by_depth": [round(n / stats.num_verify_forwards, 3) for n in stats.accepted_per_depth],
        "speedup_median": round(statistics.median(ratios), 3),
        "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "plain_tokens_per_s": round(new_tokens / statistics.median(plain_times), 1),
        "medusa_tokens_per_s": round(new_tokens / statistics.median(medusa_times), 1),
        "outputs_equal_to_plain": f"{num_equal}/{len(ratios)}",
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--heads", type=Path, default=REFERENCE_HEADS_DIR, help="heads folder (with training.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = reference.load("target")
    heads = MedusaHeads.from_pretrained(args.heads, dtype=torch.float32)
    num_prompts, repeats = (2, 1) if args.quick else (6, 2)
    prompts = reference.held_out_sequences(tokenizer, seq_len=args.prompt_len, max_rows=num_prompts * 7)[::7]
    results = {name: run_tree(model, heads, prompts, tree, args.new_tokens, repeats, GREEDY)
               for name, tree in trees(args.heads).items()}
    sampled = {name: run_tree(model, heads, prompts, tree, args.new_tokens, repeats, SAMPLING)
               for name, tree in list(trees(args.heads).items())[:1]}
    report = {
        "command": COMMAND + (" --quick" if args.quick else ""),
        "model": "hf_accel reference target (fp32 compute)",
        "heads": str(args.heads.relative_to(ROOT) if args.heads.is_relative_to(ROOT) else args.heads),
        "settings": {"batch_size": 1, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "prompts": int(prompts.shape[0]), "repeats": repeats, "torch_threads": args.threads},
        "hardware": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "trees": results,
        "sampling": {"settings": SAMPLING, "trees": sampled},
    }
    print(json.dumps(report, indent=2))
    if not args.quick and args.heads == REFERENCE_HEADS_DIR:
        out = ROOT / "benchmarks" / "results" / "bench_medusa.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
