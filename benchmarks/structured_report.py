"""bench_structured.py's targets and page: the report's rows checked against the issue's targets, and the markdown
docs/bench_structured.md holds."""

from __future__ import annotations

from typing import Any

from hf_accel.bench.output import target_table

from structured_generate_jump import render_generate_jump_forward
from structured_peer import peer_lines

FIRST_SIGHT = "jump-forward, schemas not seen before"  # no learned spellings (`forced_spelling.py`) at its start


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    invalid = sum(row["invalid"] for row in report["validity"])
    found.append({"name": "invalid finished outputs (every mode, schema, prompt)", "goal": "= 0", "value": invalid,
                  "met": invalid == 0})
    for row in report["engine_overhead"] + report["generate_overhead"]:
        if not row["jump_forward"] and row["batch"] in (1, 8):
            found.append({"name": f"{row['where']} constrained / unconstrained tok/s, batch {row['batch']}",
                          "goal": ">= 0.95", "value": row["ratio"], "met": row["ratio"] >= 0.95})
    compile_row = report["compile_beside_decoding"]
    found.append({"name": "step time while a large schema compiles / without", "goal": "<= 1.05",
                  "value": compile_row["ratio"], "met": compile_row["ratio"] <= 1.05})
    for where, key in (("engine", "jump_forward"), ("generate", "generate_jump_forward")):
        for row in report[key]:
            if row["mode"] == "jump-forward + suffix":
                found.append({"name": f"{where} jump-forward + suffix / constrained plain, batch {row['batch']}",
                              "goal": ">= 1.5", "value": row["vs_constrained_plain"],
                              "met": row["vs_constrained_plain"] >= 1.5})
    for key, where in (("vllm", "reference target"), ("vllm_185M", "185M Llama")):
        peer = report.get(key, {})
        found.append({"name": f"engine json_schema / vLLM CPU build tok/s, {where}", "goal": ">= 1.0",
                      "value": peer.get("ratio"), "met": None if "ratio" not in peer else peer["ratio"] >= 1.0})
    return found


def render(report: dict[str, Any]) -> str:
    lines = ["# Structured outputs: validity, mask cost, jump-forward, vLLM", "",
             f"{report['hardware']['cpu']}; reference target, one thread, JSON schemas: "
             f"{', '.join(report['schemas'])}; at most {report['max_tokens']} tokens.", "",
             "## Validity (finished outputs parse and validate)", "",
             "| mode | valid | invalid | cut by max_tokens |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['valid']} | {r['invalid']} | {r['unfinished']} |" for r in report["validity"]]
    lines += ["", "## Cost of the mask (same tokens decoded on both sides)", "",
              "| where | batch | jump-forward | constrained tok/s | unconstrained tok/s | ratio | mask us / row |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["engine_overhead"] + report["generate_overhead"]:
        mask = "-" if r["mask_us_per_row"] is None else f"{r['mask_us_per_row']:.0f}"
        lines.append(f"| {r['where']} | {r['batch']} | {'on' if r['jump_forward'] else 'off'} | "
                     f"{r['constrained_tok_s']:.0f} | {r['unconstrained_tok_s']:.0f} | {r['ratio']:.2f}x | {mask} |")
    lines += ["", "## Jump-forward and speculation on JSON extraction (Engine, greedy)", "",
              "| batch | mode | tok/s | vs constrained plain | identical | forced tokens | accepted / drafted |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['mode']} | {r['tok_s']:.0f} | {r['vs_constrained_plain']:.2f}x | "
              f"{'yes' if r['identical'] else 'no'} | {r['forced_tokens']} | "
              f"{r['accepted_tokens']} / {r['draft_tokens']} |" for r in report["jump_forward"]]
    lines += ["", "The suffix cache is emptied before each run (it learns from the run's own earlier requests "
                  "only). Jump-forward drafts forced text as the model spelled it before (`forced_spelling.py`): "
                  "the warm-up run taught those spellings, as earlier requests with the same schema would; the "
                  f"\"{FIRST_SIGHT}\" rows run without them (and what they learn is dropped after). Forced tokens "
                  "per step: up to 4 at batch 1, 3 at batch 8."]
    lines += [""] + render_generate_jump_forward(report["generate_jump_forward"])
    c = report["compile_beside_decoding"]
    lines += ["", f"A large schema (200 nested properties) compiling beside 4 decoding requests: their step "
                  f"{c['step_ms_while_compiling']:.2f} ms during the compile ({c['steps']:.0f} steps), "
                  f"{c['step_ms']:.2f} ms without ({c['ratio']:.2f}x).", ""]
    for key, where in (("vllm", "the reference target"), ("vllm_185M", "the 185M random-weight Llama")):
        lines += peer_lines(report.get(key, {"skipped": "not run"}), where)
    lines += target_table(report["targets"])
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"
