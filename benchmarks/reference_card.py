"""Write docs/reference-models.md (the reference models' model card) from hf_accel/reference/assets/report.json and
the shipped held-out text's hf_accel/reference/assets/held_out/provenance.json.

Every number in the card comes from the report that `hf-accel train-reference` writes or from that provenance (written
by `python -m hf_accel.reference.held_out_command`), so the card and the committed checkpoints and text cannot drift
apart (tests/test_reference_assets.py checks it):
    .venv/bin/python benchmarks/reference_card.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hf_accel import reference
from hf_accel.display import format_table
from hf_accel.reference.held_out import read_provenance

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "docs" / "reference-models.md"
SPLIT_NAMES = {"train": "train", "held_out": "held-out files", "held_out_packages": "held-out packages"}
TARGET_VS_DRAFT, TARGET_VS_V1 = 0.85, 0.7  # issue 14's targets, on the by-package split


def _shape(p: dict[str, Any]) -> str:
    return (f"{p['num_layers']} x hidden {p['hidden_size']}, {p['num_heads']} heads / {p['num_kv_heads']} KV heads "
            f"(head dim {p['hidden_size'] // p['num_heads']}), MLP {p['intermediate_size']}")


def _corpus_of(report: dict[str, Any], model: dict[str, Any]) -> str:
    if model.get("train_fingerprint") == report["corpus"]["splits"]["train"]["fingerprint"]:
        return "of the train split below"
    return "of an earlier corpus, not the one below"


def _stages(model: dict[str, Any]) -> list[dict[str, Any]]:
    """A model's training stages, oldest first: the records of the runs it was grown or continued from, then its own."""
    earlier = model.get("start", {}).get("earlier")
    return (_stages(earlier) if earlier else []) + [model]


def _totals(model: dict[str, Any]) -> tuple[float, float, float]:
    """(tokens seen, seconds, epochs) over every stage."""
    stages = _stages(model)
    return tuple(sum(s[key] for s in stages) for key in ("tokens_seen", "train_seconds", "epochs"))


def _training(report: dict[str, Any], model: dict[str, Any]) -> str:
    parts = []
    for stage in _stages(model):
        r = stage["recipe"]
        how = "distilled from the target, " if stage.get("start", {}).get("distill_from") else ""
        layers = stage["preset"]["num_layers"]
        parts.append(f"{layers} layer{'s' if layers > 1 else ''}: {how}{stage['steps_done']} x {r['batch_size']} x "
                     f"{r['seq_len']} tokens = {stage['tokens_seen'] / 1e6:.2f}M, lr {r['lr']}")
    tokens, _, epochs = _totals(model)
    total = f" ({epochs:.2f} epochs {_corpus_of(report, model)})"
    if len(parts) == 1:
        return parts[0] + total
    return "; then ".join(parts) + f"; {tokens / 1e6:.2f}M in all{total}"


def _model_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name in reference.MODEL_NAMES:
        m = report["models"][name]
        p, ppl = m["preset"], m["held_out_perplexity"]
        rows.append([
            name, f"{m['parameters'] / 1e6:.2f}M", _shape(p), str(p["context_length"]), _training(report, m),
            f"{_totals(m)[1] / 60:.1f} min", f"{ppl['held_out']:.2f}", f"{ppl['held_out_packages']:.2f}",
        ])
    if "baseline_target" in report:
        b = report["baseline_target"]
        rows.append(["v1 target (before)", f"{b['parameters'] / 1e6:.2f}M", "10 x hidden 256, trained on the stdlib",
                     "512", "-", "-", f"{b['held_out_perplexity']['held_out']:.2f}",
                     f"{b['held_out_perplexity']['held_out_packages']:.2f}"])
    return rows


def _targets(report: dict[str, Any]) -> list[list[str]]:
    target = report["models"]["target"]["held_out_perplexity"]["held_out_packages"]
    rows = [[f"target ppl <= {TARGET_VS_DRAFT}x the draft's (held-out packages)",
             f"{target / report['models']['draft']['held_out_perplexity']['held_out_packages']:.3f}x"]]
    if "baseline_target" in report:
        v1 = report["baseline_target"]["held_out_perplexity"]["held_out_packages"]
        rows.append([f"target ppl <= {TARGET_VS_V1}x the v1 target's (held-out packages)", f"{target / v1:.3f}x"])
    limits = [TARGET_VS_DRAFT, TARGET_VS_V1]
    return [[text, value, "yes" if float(value[:-1]) <= limit else "**no**"]
            for (text, value), limit in zip(rows, limits)]


def _cost(report: dict[str, Any]) -> str:
    target, draft = report["models"]["target"], report["models"]["draft"]
    cost = report["token_forward_ms"]
    return (f"- cost per token: the target has **{target['parameters'] / draft['parameters']:.1f}x** the draft's "
            f"parameters and {target['preset']['num_layers']}x its layers; one single-token forward (batch 1, "
            f"{cost['context']} tokens cached, fp32, {cost['threads']} thread, timed alternately) takes "
            f"{cost['target']:.2f} ms vs {cost['draft']:.2f} ms, **{cost['target'] / cost['draft']:.1f}x**: at this "
            "size a forward's cost follows the layer count more than the parameter count")


def _provenance(report: dict[str, Any]) -> list[str]:
    """A stated caveat when the shipped models were trained on another corpus than the one this card describes."""
    fingerprint = report["corpus"]["splits"]["train"]["fingerprint"]
    if all(m.get("train_fingerprint") == fingerprint for m in report["models"].values()):
        return []
    return ["- **the shipped checkpoints predate the corpus below**: they were trained on an earlier corpus (the "
            "previous release's, the standard library only) and are measured here on the held-out splits of the "
            "current one; `hf-accel train-reference` trains new ones on it"]


def _corpus_tables(corpus: dict[str, Any]) -> tuple[str, str]:
    splits = format_table(["split", "files", "bytes", "tokens", "fingerprint (SHA-256 of paths + contents)"], [
        [SPLIT_NAMES[name], f"{s['files']:,}", f"{s['bytes']:,}", f"{s['tokens']:,}", f"`{s['fingerprint'][:16]}...`"]
        for name, s in corpus["splits"].items()], markdown=True)
    sources = format_table(
        ["source", "version", "licence (from its metadata)", "train files", "held-out files", "held-out package files",
         "exact duplicates dropped", "near duplicates dropped"],
        [[s["name"], s["version"], s["licence"], str(s["files"]["train"]), str(s["files"]["held_out"]),
          str(s["files"]["held_out_packages"]), str(s["exact_duplicates"]), str(s["near_duplicates"])]
         for s in corpus["sources"]], markdown=True)
    return splits, sources


def _corpus_text(corpus: dict[str, Any]) -> list[str]:
    rules = corpus["rules"]
    splits, sources = _corpus_tables(corpus)
    return [
        "## Corpus", "",
        "Python source that any machine has after `pip install -c constraints.txt -e \".[dev]\"`: the standard "
        "library plus a fixed list of distributions, exactly those pinned in `constraints.txt` (so packages added to "
        "the environment later do not change it); see `hf_accel/reference/sources.py` and `corpus.py`. Per source: "
        "`*.py` files only, in sorted path order, minus test suites (`test`, `tests`, `testing` folders), files over "
        f"{rules['max_file_bytes']:,} bytes (generated tables), and for the stdlib the folders that distributors ship "
        "separately or that hold generated data (`idlelib`, `tkinter`, `encodings`, `pydoc_data`, ...).", "",
        "- **de-duplication**, in corpus order (stdlib, training packages, held-out packages): a file whose text "
        "equals an earlier one's is dropped (exact duplicates); so is a file with at least "
        f"{rules['near_dup_min_lines']} distinct code lines (stripped, >= {rules['near_dup_line_chars']} characters) "
        f"of which at least {100 * rules['near_dup_share']:.0f}% already occurred in earlier kept files (near "
        "duplicates, such as transformers' modeling files assembled from copied code and their `modular_*` sources)",
        "- **held-out packages**: every file of `accelerate` and `pytest` (whole packages never trained on: the "
        "perplexity there measures generalisation, not memory)",
        f"- **held-out files**: among the other sources, a file whose path inside its source hashes (first 8 bytes "
        f"of SHA-256) into the lowest {rules['held_out_percent']}% of the range; the stdlib's held-out files are the "
        "same as in the stdlib-only v1 corpus", "",
        splits, "", sources, "",
        "Token counts exclude the end-of-text separators. Licences are the distributions' own declarations "
        "(`License-Expression`, else `License`, else the licence classifiers); the stdlib is under the PSF licence.",
        "",
    ]


def _held_out_text(shipped: dict[str, Any]) -> list[str]:
    """The section on the held-out text shipped in the package, from its provenance.json."""
    return [
        "## Held-out text shipped in the package", "",
        "`hf-accel bench`, the benchmarks, the notebooks and the tests take their prompts and scored rows from "
        "`reference.held_out_sequences`, which reads text shipped in the package rather than the installed corpus, so "
        "every install (the base one included, where the corpus's packages are missing) and every Python version "
        f"gets the same prompts: the standard library's held-out files of CPython {shipped['python']}, "
        f"{shipped['files']} files, {shipped['bytes']:,} bytes, {shipped['tokens']:,} tokens, licensed "
        f"{shipped['licence']} (the Python Software Foundation License; the Python licence file ships beside them "
        f"as `{shipped['licence_file']}`). They are the first files of the held-out split above, in corpus order and "
        "as the corpus reads them, so rows cut from them equal the first rows cut from that split.", "",
        "- files: `hf_accel/reference/assets/held_out/files.jsonl`, one JSON object `{\"path\", \"text\"}` per "
        f"line (SHA-256 `{shipped['sha256'][:16]}...`; fingerprint of paths + contents "
        f"`{shipped['fingerprint'][:16]}...`); `provenance.json` beside it holds these numbers",
        f"- rebuilt by `{shipped['command']}` (with Python {shipped['python']} to reproduce it byte for byte)",
        "- the held-out packages split is not shipped: `held_out_sequences(split=\"held_out_packages\")`, training "
        "and the perplexities above read the corpus, which needs `pip install -c constraints.txt -e \".[dev]\"`",
        "",
    ]


def _details(report: dict[str, Any]) -> list[str]:
    torch_info, rules, target = report["torch"], report["corpus"]["rules"], report["models"]["target"]
    return [
        _cost(report),
        *_provenance(report),
        f"- greedy next-token agreement of the draft with the target on the held-out package rows: "
        f"**{100 * report['greedy_agreement']:.1f}%** (the acceptance rate of one greedy speculative token)",
        f"- held-out perplexity: every position but the first of {rules['eval_rows']} rows of "
        f"{rules['eval_seq_len']} tokens per split (files joined by the end-of-text token, rows evenly spaced over "
        "the split), the models loaded back from their saved bf16 weights and run in fp32"
        + ("; the v1 target (the previous release, trained on the stdlib only) measured on the same rows"
           if "baseline_target" in report else ""),
        "- weights stored as bf16 safetensors with tied embeddings; `reference.load` upcasts to fp32 by default",
        "- trained with AdamW (weight decay 0.1, grad clip 1.0), linear warmup then cosine decay to 10%, "
        f"{'CPU bf16 autocast' if target['recipe']['bf16_autocast'] else 'fp32'}, seed 0, one torch thread; the "
        f"target saw {_totals(target)[2]:.2f} epochs {_corpus_of(report, target)} "
        f"({_totals(target)[0] / max(1.0, _totals(target)[1]):.0f} tokens/s, on a 2-core machine shared "
        f"with other jobs); measured with torch {torch_info['version']}, Python {report['python']}",
        *_lineage(report),
    ]


def _lineage(report: dict[str, Any]) -> list[str]:
    """A line per model trained in more than one stage: what each earlier stage reached."""
    lines = []
    for name in reference.MODEL_NAMES:
        stages = _stages(report["models"][name])
        for earlier, later in zip(stages, stages[1:]):
            grown = later["preset"]["num_layers"] != earlier["preset"]["num_layers"]
            how = (f"grown from {earlier['preset']['num_layers']} to {later['preset']['num_layers']} layers (each "
                   "layer copied, the copies' output projections zeroed: the same function at the first step)"
                   if grown else "continued")
            if later.get("start", {}).get("distill_from"):
                how += ", trained on the target's next-token distributions (KL) instead of the text"
            lines.append(f"- the {name} was trained in stages: after {earlier['steps_done']} steps "
                         f"({earlier['train_seconds'] / 60:.0f} min) it reached held-out perplexity "
                         f"{earlier['held_out_perplexity']['held_out']:.2f} / "
                         f"{earlier['held_out_perplexity']['held_out_packages']:.2f} (files / packages); then {how}, "
                         f"on rows it had not seen, for {later['train_seconds'] / 60:.0f} min more")
    return lines


def render(report: dict[str, Any], shipped: dict[str, Any]) -> str:
    """The model card's markdown; `shipped`: the held-out text's provenance.json."""
    target, draft = report["models"]["target"], report["models"]["draft"]
    minutes = (_totals(target)[1] + _totals(draft)[1]) / 60
    models = format_table(["model", "parameters", "shape", "context", "training", "train time",
                           "ppl held-out files", "ppl held-out packages"], _model_rows(report), markdown=True)
    return "\n".join([
        "# Reference models", "",
        "hf_accel ships two small `LlamaForCausalLM` checkpoints, trained here from scratch on Python source, as the "
        "default that `hf-accel bench`, the notebooks and the quality benchmarks run on, offline:",
        "", "```python", "from hf_accel import reference",
        'model, tokenizer = reference.load("target")   # or "draft"; plain from_pretrained on a local folder', "```",
        "", f"They are small so that both train from scratch on a 2-core CPU in a few hours ({minutes:.0f} min "
        "here, each mostly on one thread of a machine shared with other jobs); they write plausible-looking Python but are "
        "not useful models. Their job is to make acceptance rates, perplexity under KV quantization and generated "
        "text real. Your own model goes in with `--model <path or hub id>`.", "",
        "## Models", "", models, "",
        format_table(["target (issue 14)", "measured", "met"], _targets(report), markdown=True), "",
        *_details(report), "",
        *_corpus_text(report["corpus"]),
        *_held_out_text(shipped),
        "## Tokenizer", "",
        f"Byte-level BPE (`tokenizers`), {report['tokenizer']['vocab_size']} tokens, trained on the stdlib (the v1 "
        "corpus) and kept for v2 so that perplexities compare token for token with the v1 target; `decode(encode(x))` "
        "is exact for any string. One special token `<|endoftext|>` (bos = eos = pad, end of a file and end of a chat "
        "turn). Chat template (`apply_chat_template`, the server's chat endpoint): each message as a `<|role|>` line, "
        "its content and `<|endoftext|>`, then a newline; the generation prompt is `<|assistant|>` and a newline.", "",
        "## Reproduce", "",
        "```bash",
        "# the shipped models, in two stages. First (v2) each trained in resumed stretches on one thread, the learning",
        "# rate decaying on the time budget of the last stretch (the target: 4200 s, then resumed to 9900 s in all; the",
        "# draft: 1200 s, then 2100 s, then 2700 s; a resumed stretch re-warms the rate to where its budget puts it):",
        "hf-accel train-reference --which target --out v2 --threads 1 --steps 10000 --time-budget 9900 --checkpoint-dir ckpt \\",
        "    --resume",
        "hf-accel train-reference --which draft --out v2 --threads 1 --steps 9000 --time-budget 2700 --checkpoint-dir ckpt \\",
        "    --resume",
        "# then (v3) the target grown to 8 layers, and the draft continued as the grown target's student:",
        "hf-accel train-reference --which target --out v3 --grow-from v2 --skip-batches 5248 --lr 1e-3 --steps 10000 \\",
        "    --time-budget 4500 --threads 1",
        "hf-accel train-reference --which draft --out v3 --grow-from v2 --skip-batches 3482 --distill-from v3 --lr 1e-3 \\",
        "    --steps 10000 --time-budget 1800 --threads 1",
        "hf-accel train-reference --which none --baseline <v1 assets>   # only measure (here: the v1 target)",
        "hf-accel train-reference --which draft --steps 50 --out /tmp/ref   # a quick run elsewhere",
        "# in general, a deeper target from a trained one: its layers copied up to the preset's depth (a multiple of its own),",
        "# each copy's output projections zeroed (the same function at step 0), then trained on the rows that the",
        "# trained one never saw (--skip-batches: its steps) at a lower peak learning rate",
        "hf-accel train-reference --which target --grow-from <assets> --skip-batches <its steps> --lr 1e-3 --threads 1",
        "# a draft that imitates a target (KL to its next-token distribution) rather than the text",
        "hf-accel train-reference --which draft --distill-from <assets with the target> --threads 1",
        "```", "",
        "Every number above comes from `hf_accel/reference/assets/report.json`, which that command writes, or from "
        "the shipped held-out text's `provenance.json`; `benchmarks/reference_card.py` renders this page from them.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> str:
    report = json.loads((reference.ASSETS_DIR / "report.json").read_text())
    text = render(report, read_provenance())
    CARD.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
