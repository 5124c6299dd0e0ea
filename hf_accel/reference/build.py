"""The reference-model pipeline: corpus -> tokenizer -> packed rows -> train, save, reload, measure -> report.json.

``report.json`` in the assets folder holds every number the model card states; a run that trains one model keeps
the other model's record from the previous report.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from . import ASSETS_DIR, MODEL_NAMES, load
from .corpus import HELD_OUT_PERCENT, Corpus, load_split, pack_sequences, tokenize
from .evaluate import greedy_agreement, perplexity
from .loop import build_model, num_parameters, save_model, train_model
from .presets import MODEL_PRESETS, TrainRecipe
from .tokenizer import DEFAULT_VOCAB_SIZE, save_tokenizer, train_tokenizer

EVAL_SEQ_LEN = 512


def prepare_tokenizer(
    out: Path, train_texts: list[str], retrain: bool, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> tuple[PreTrainedTokenizerBase, float | None]:
    """The tokenizer in ``out/tokenizer``, trained and saved there first if absent or ``retrain``; returns it and
    its training time in seconds (``None`` when reused)."""
    folder = out / "tokenizer"
    if (folder / "tokenizer.json").is_file() and not retrain:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True), None
    start = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, vocab_size)
    seconds = time.perf_counter() - start
    save_tokenizer(tokenizer, folder)
    return tokenizer, seconds


def _corpus_record(corpus: Corpus, token_ids: list[list[int]]) -> dict:
    return {
        "files": corpus.num_files,
        "bytes": corpus.num_bytes,
        "tokens": sum(len(ids) for ids in token_ids),
        "fingerprint": corpus.fingerprint,
    }


def train_one(
    name: str,
    recipe: TrainRecipe,
    tokenizer: PreTrainedTokenizerBase,
    token_ids: tuple[list[list[int]], list[list[int]]],
    out: Path,
    time_budget_s: float | None,
    progress: bool,
) -> dict:
    """Train ``name`` on the train ids, save it to ``out/name``, reload the saved files and measure held-out
    perplexity; returns the model's report record."""
    train_ids, held_out_ids = token_ids
    rows = pack_sequences(train_ids, tokenizer.eos_token_id, recipe.seq_len)
    model = build_model(MODEL_PRESETS[name], tokenizer, recipe.seed)
    result = train_model(model, rows, recipe, time_budget_s, progress)
    save_model(model, tokenizer, out / name)
    saved, _ = load(name, assets_dir=out)
    held_out_rows = pack_sequences(held_out_ids, tokenizer.eos_token_id, EVAL_SEQ_LEN)
    return {
        "parameters": num_parameters(saved),
        "preset": asdict(MODEL_PRESETS[name]),
        "recipe": asdict(recipe),
        "steps_done": result.steps_done,
        "train_seconds": round(result.seconds, 1),
        "tokens_seen": result.tokens_seen,
        "epochs": round(result.tokens_seen / rows.numel(), 3),
        "final_train_loss": round(result.final_loss(), 4),
        "held_out_perplexity": round(perplexity(saved, held_out_rows), 3),
    }


def measure_agreement(out: Path, held_out_ids: list[list[int]], separator_id: int) -> float | None:
    """Greedy next-token agreement of the saved draft with the saved target on held-out rows; ``None`` unless
    both are in ``out``."""
    if not all((out / name / "config.json").is_file() for name in MODEL_NAMES):
        return None
    draft, _ = load("draft", assets_dir=out)
    target, _ = load("target", assets_dir=out)
    return round(greedy_agreement(draft, target, pack_sequences(held_out_ids, separator_id, EVAL_SEQ_LEN)), 4)


def build_reference(
    names: Sequence[str],
    recipes: dict[str, TrainRecipe],
    out: Path | None = None,
    time_budget_s: float | None = None,
    retrain_tokenizer: bool = False,
    progress: bool = True,
) -> Path:
    """Run the pipeline for ``names`` (a subset of "target", "draft") into ``out`` (default: the package's
    assets); returns the path of the written ``report.json``."""
    out = ASSETS_DIR if out is None else Path(out)
    train, held_out = load_split("train"), load_split("held_out")
    tokenizer, tokenizer_seconds = prepare_tokenizer(out, train.texts, retrain_tokenizer)
    token_ids = (tokenize(train.texts, tokenizer), tokenize(held_out.texts, tokenizer))
    report = _previous_report(out)
    report["python"] = platform.python_version()
    report["torch"] = {"version": torch.__version__, "threads": torch.get_num_threads()}
    report["corpus"] = {
        "held_out_percent": HELD_OUT_PERCENT,
        "train": _corpus_record(train, token_ids[0]),
        "held_out": _corpus_record(held_out, token_ids[1]),
    }
    report.setdefault("tokenizer", {})["vocab_size"] = len(tokenizer)
    if tokenizer_seconds is not None:
        report["tokenizer"]["train_seconds"] = round(tokenizer_seconds, 1)
    models = report.setdefault("models", {})
    for name in names:
        models[name] = train_one(name, recipes[name], tokenizer, token_ids, out, time_budget_s, progress)
    report["greedy_agreement"] = measure_agreement(out, token_ids[1], tokenizer.eos_token_id)
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def _previous_report(out: Path) -> dict:
    path = out / "report.json"
    return json.loads(path.read_text()) if path.is_file() else {}
