"""Jump-forward in `generate` for bench_structured.py: the JSON-extraction workload through `model.generate` (eager,
DynamicCache, greedy), one call per schema: constrained decoding without jump-forward (`StructuredOutput(...,
jump_forward=False)`), with it (generate's default: `jump_forward_generate`), and jump-forward + `ngram_generate`
with a `SuffixCache` shared across the calls; interleaved, outputs compared token for token. Jump-forward drafts forced
text as the model spelled it in earlier calls (`structured/forced_spelling.py`): the warm-up run teaches it, as a
schema used before would; the last mode runs without those spellings (a schema's first calls), and what it learns
is dropped after it, so the modes that run next still have them.

At batch 1 each schema's extraction prompt is one call; at batch 8 one call per schema holds 8 variants of its prompt
(a call takes one constraint).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import hf_accel
from hf_accel import StructuredOutput
from hf_accel.bench.timing import time_interleaved
from hf_accel.structured.forced_spelling import spellings_forgotten

from structured_schemas import SCHEMAS, extraction_prompt

MODES = ("constrained plain", "jump-forward", "jump-forward + suffix", "jump-forward, schemas not seen before")


def generate_jump_forward(model, tokenizer, max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Per batch size (1, 8) and mode: tok/s over the 8 schemas' calls, the ratio to constrained plain decoding
    (median of the interleaved repeats' ratios), and whether the outputs are identical to it."""
    tokenizer.padding_side = "left"
    rows = []
    for batch in (1, 8):
        calls = [(name, tokenizer([extraction_prompt(name, v) for v in range(batch)], return_tensors="pt",
                                  padding=True, add_special_tokens=False)) for name in SCHEMAS]
        def run(mode: str) -> tuple[float, list[list[int]]]:
            if mode == MODES[-1]:  # nor from the spellings of forced text earlier calls learned (kept for the others)
                with spellings_forgotten():
                    return calls_run(mode)
            return calls_run(mode)

        def calls_run(mode: str) -> tuple[float, list[list[int]]]:
            suffix = hf_accel.SuffixCache()  # fresh each run: a repeat never drafts from its own earlier outputs
            outputs, start = [], time.perf_counter()
            for name, inputs in calls:
                constraint = StructuredOutput(json=SCHEMAS[name]["schema"], jump_forward=mode != "constrained plain")
                extra = {"custom_generate": hf_accel.ngram_generate, "suffix_cache": suffix} if "suffix" in mode \
                    else {}
                out = model.generate(**inputs, max_new_tokens=max_tokens, structured_output=constraint,
                                     tokenizer=tokenizer, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                     **extra)
                width = inputs["input_ids"].shape[1]
                outputs += [[t for t in row if t != tokenizer.pad_token_id] for row in out[:, width:].tolist()]
            return time.perf_counter() - start, outputs

        timings = time_interleaved(list(MODES), run, repeats)
        plain = timings.outputs["constrained plain"]
        tokens = sum(len(row) for row in plain)
        base = timings.seconds["constrained plain"]
        rows += [{"batch": batch, "mode": mode, "tok_s": tokens / statistics.median(timings.seconds[mode]),
                  "vs_constrained_plain": statistics.median(b / s for b, s in zip(base, timings.seconds[mode])),
                  "identical": timings.outputs[mode] == plain} for mode in MODES]
    return rows


def render_generate_jump_forward(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown section of `generate_jump_forward`'s rows."""
    lines = ["## Jump-forward in generate (eager, DynamicCache, greedy; one call per schema)", "",
             "| batch | mode | tok/s | vs constrained plain | identical |", "| --- | --- | --- | --- | --- |"]
    return lines + [f"| {r['batch']} | {r['mode']} | {r['tok_s']:.0f} | {r['vs_constrained_plain']:.2f}x | "
                    f"{'yes' if r['identical'] else 'no'} |" for r in rows]
