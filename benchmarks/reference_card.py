"""Write docs/reference-models.md (the reference models' model card) from hf_accel/reference/assets/report.json.

Every number in the card comes from the report that `hf-accel train-reference` writes, so the card and the committed
checkpoints cannot drift apart (tests/test_reference_assets.py checks it):
    .venv/bin/python benchmarks/reference_card.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hf_accel import reference
from hf_accel.bench import format_table

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "docs" / "reference-models.md"


def _model_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name in reference.MODEL_NAMES:
        m = report["models"][name]
        p, r = m["preset"], m["recipe"]
        rows.append([
            name, f"{m['parameters'] / 1e6:.2f}M",
            f"{p['num_layers']} x hidden {p['hidden_size']}, {p['num_heads']} heads / {p['num_kv_heads']} KV heads "
            f"(head dim {p['hidden_size'] // p['num_heads']}), MLP {p['intermediate_size']}",
            str(p["context_length"]),
            f"{m['steps_done']} x {r['batch_size']} x {r['seq_len']} tokens ({m['epochs']:.2f} epochs), lr {r['lr']}",
            f"{m['train_seconds'] / 60:.1f} min", f"{m['held_out_perplexity']:.2f}",
        ])
    return rows


def _train_minutes(report: dict[str, Any]) -> str:
    return f"{sum(m['train_seconds'] for m in report['models'].values()) / 60:.0f}"


def _limits(report: dict[str, Any]) -> list[str]:
    """A stated caveat when the target does not beat its draft on held-out text."""
    target, draft = report["models"]["target"], report["models"]["draft"]
    if target["held_out_perplexity"] < draft["held_out_perplexity"]:
        return []
    return [f"- **the target does not beat its draft on held-out text** ({target['held_out_perplexity']:.1f} vs "
            f"{draft['held_out_perplexity']:.1f}): with {report['corpus']['train']['tokens'] / 1e6:.2f}M training "
            f"tokens (all of the stdlib) and a one-core CPU budget, the deep, narrow target reaches about the draft's "
            f"train loss ({target['final_train_loss']:.2f} vs {draft['final_train_loss']:.2f}) and overfits a little "
            f"over {target['epochs']:.1f} epochs. It is still a real draft/target pair for speculative decoding (the "
            "agreement above; measured acceptance in [bench_speculative.md](bench_speculative.md)); a wider, "
            "shallower target or a larger corpus is the known fix."]


def render(report: dict[str, Any]) -> str:
    """The model card's markdown."""
    corpus, torch_info = report["corpus"], report["torch"]
    train, held = corpus["train"], corpus["held_out"]
    models = format_table(["model", "parameters", "shape", "context", "training", "train time", "held-out ppl"],
                          _model_rows(report), markdown=True)
    return "\n".join([
        "# Reference models", "",
        "hf_accel ships two small `LlamaForCausalLM` checkpoints, trained here from scratch on Python source, as the "
        "default that `hf-accel bench`, the notebooks and the quality benchmarks run on, offline:", "",
        "```python", "from hf_accel import reference",
        'model, tokenizer = reference.load("target")   # or "draft"; plain from_pretrained on a local folder', "```",
        "", f"They are small so that both train from scratch on a 2-core CPU in under an hour ({_train_minutes(report)} "
        "min here, on one thread of a machine shared with other jobs); they write plausible-looking Python but "
        "are not useful models. Their job is to make acceptance rates, perplexity under KV quantization and generated "
        "text real. Your own model goes in with `--model <path or hub id>`.", "",
        "## Models", "", models, "",
        f"- greedy next-token agreement of the draft with the target on the held-out rows: "
        f"**{100 * report['greedy_agreement']:.1f}%** (the acceptance rate of one greedy speculative token)",
        *_limits(report),
        "- held-out perplexity: every position but the first of each 512-token held-out row (files joined by the "
        "end-of-text token), the models loaded back from their saved bf16 weights and run in fp32",
        "- weights stored as bf16 safetensors with tied embeddings; `reference.load` upcasts to fp32 by default",
        f"- trained with AdamW (weight decay 0.1, grad clip 1.0), linear warmup then cosine decay to 10%, fp32 master "
        f"weights, CPU bf16 autocast, seed 0, {torch_info['threads']} torch thread(s), torch {torch_info['version']}, "
        f"Python {report['python']} (times measured on a shared 2-core Xeon)", "",
        "## Corpus", "",
        "The Python standard library's own `*.py` files (the interpreter's `sysconfig` stdlib folder), listed by "
        "relative path in sorted order, minus test suites, `site-packages`, and folders that distributors ship "
        "separately or that hold generated data (`idlelib`, `turtledemo`, `tkinter`, `lib2to3`, `distutils`, "
        "`ensurepip`, `encodings`, `pydoc_data`, `config-*`, `_sysconfigdata_*`); see `hf_accel/reference/corpus.py`. "
        f"A file is held out when the first 8 bytes of the SHA-256 of its path fall in the lowest "
        f"{corpus['held_out_percent']}% of the range: the split depends on the path alone.", "",
        format_table(["split", "files", "bytes", "tokens", "fingerprint (SHA-256 of paths + contents)"], [
            ["train", str(train["files"]), f"{train['bytes']:,}", f"{train['tokens']:,}", f"`{train['fingerprint'][:16]}...`"],
            ["held-out", str(held["files"]), f"{held['bytes']:,}", f"{held['tokens']:,}", f"`{held['fingerprint'][:16]}...`"],
        ], markdown=True), "",
        f"Tokenizer: byte-level BPE (`tokenizers`), {report['tokenizer']['vocab_size']} tokens, trained on the train "
        "split, one special token `<|endoftext|>` (bos = eos = pad); saved as `tokenizer.json` and loadable with "
        "`AutoTokenizer.from_pretrained(folder)`. Token counts exclude the separators.", "",
        "## Reproduce", "",
        "```bash", "hf-accel train-reference                # both models, the default recipes, into the package's assets",
        "hf-accel train-reference --which draft --steps 50 --out /tmp/ref   # a quick run elsewhere", "```", "",
        "Every number above comes from `hf_accel/reference/assets/report.json`, which that command writes; "
        "`benchmarks/reference_card.py` renders this page from it. The license of the training text is the PSF "
        "license of the Python standard library.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> str:
    report = json.loads((reference.ASSETS_DIR / "report.json").read_text())
    text = render(report)
    CARD.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
