"""Tables of a fine-tune report (`report.json`): perplexity per stage, speed per side (not in an adapter-only
report), time per stage.

`report_tables(report)` gives `display.Table`s (HTML in Jupyter, aligned text in a terminal); `report_markdown`
the same tables as GitHub markdown, for docs/bench_finetune.md.
"""

from __future__ import annotations

from typing import Any

from ..display import Table

STAGE_NAMES = {"base": "base model", "finetuned": "fine-tuned (LoRA merged)", "quantized": "fine-tuned, quantized"}
ADAPTER_STAGE_NAMES = {"base": "base model", "finetuned": "base + LoRA adapter (unmerged)"}
EVAL_NAMES = {"domain": "held-out domain text", "original": "base model's own held-out domain"}
SPEED_COLUMNS = ["side", "tokens/s", "speed vs plain float", "tokens equal to plain float", "tokens per forward"]
AGREEMENT_COLUMN = "top-1 agreement with float (same prefix)"


def perplexity_table(report: dict[str, Any]) -> Table:
    """One row per stage (base, fine-tuned, quantized), one column per evaluation set, and (for a merged
    fine-tune) the share of held-out domain positions where the stage's next-token argmax equals the float
    fine-tuned model's."""
    stages, adapter_only = report["perplexity"], "top1_agreement_with_float" not in report
    sets = list(next(iter(stages.values())))
    names = ADAPTER_STAGE_NAMES if adapter_only else STAGE_NAMES
    rows = [[names.get(stage, stage), *(values[name] for name in sets)] for stage, values in stages.items()]
    columns = ["stage", *(EVAL_NAMES.get(s, s) for s in sets)]
    if not adapter_only:
        agreement = {"finetuned": "100%", "quantized": f"{100 * report['top1_agreement_with_float']:.1f}%"}
        rows = [[*row, agreement.get(stage, "-")] for row, stage in zip(rows, stages)]
        columns.append(AGREEMENT_COLUMN)
    return Table("held-out perplexity (lower is better)", columns, rows)


def speed_table(report: dict[str, Any]) -> Table:
    """One row per decoding side, the first (plain generate on the float model) the baseline."""
    rows = [[r["side"], r["tokens_per_s"], f"{r['speed_ratio']:.2f}x", f"{100 * r['greedy_agreement']:.1f}%",
             "-" if r["tokens_per_step"] is None else r["tokens_per_step"]] for r in report["speed"]]
    settings = report["settings"]
    title = (f"greedy decoding, batch 1, {settings['prompt_len']}-token prompts, {settings['new_tokens']} new tokens, "
             f"{settings['speed_prompts']} prompts x {settings['repeats']} repeats")
    return Table(title, SPEED_COLUMNS, rows)


def time_table(report: dict[str, Any]) -> Table:
    """Seconds per stage, in the order they ran."""
    return Table("time per stage (s)", ["stage", "seconds"], [[k, v] for k, v in report["times_s"].items()])


def report_tables(report: dict[str, Any]) -> list[Table]:
    """The perplexity, speed (a merged fine-tune's) and time tables of `report`."""
    speed = [speed_table(report)] if "speed" in report else []
    return [perplexity_table(report), *speed, time_table(report)]


def report_markdown(report: dict[str, Any]) -> str:
    """The tables of `report` as markdown, with the model, data and hardware they were measured on."""
    hw, data, lora = report["hardware"], report["data"], report["settings"]["lora"]
    lines = [
        f"Model: {report['model']}; {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, "
        f"transformers {hw['transformers']}.",
        f"Data: {data['source']}; {data['train_rows']} train rows and {data['held_out_rows']} held-out rows of "
        f"{data['seq_len']} tokens; held-out distributions: {', '.join(data['held_out_distributions'])}.",
        f"LoRA rank {lora['rank']}, alpha {lora['alpha']}, {lora['steps']} steps of {lora['batch_size']} rows, "
        f"lr {lora['lr']}; Medusa heads: {report['medusa']['steps']} steps on {report['medusa']['self_distill_rows']} "
        f"self-distilled rows, initialised from {report['medusa']['initialised_from']}; weights: "
        f"{report['settings']['quant'] or 'float'}.",
    ]
    tables = "\n\n".join(table.markdown() for table in report_tables(report))
    return "\n".join(lines) + "\n\n" + tables + "\n\n" + report["speed_rule"].capitalize() + ".\n"


__all__ = ["perplexity_table", "report_markdown", "report_tables", "speed_table", "time_table"]
