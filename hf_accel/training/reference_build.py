"""The reference-model pipeline: corpus -> tokenizer -> packed rows -> train, save, reload, measure -> report.json.

``report.json`` in the assets folder holds every number the model card states. It is re-read just before it is
written, so a run that trains one model keeps the other model's record, and two runs training different models into
the same folder (the draft beside the target) do not undo each other.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..reference import ASSETS_DIR, MODEL_NAMES, load
from ..reference.corpus import (
    HELD_OUT_PERCENT, NEAR_DUP_LINE_CHARS, NEAR_DUP_MIN_LINES, NEAR_DUP_SHARE, Corpus, SplitCorpus, default_corpus,
    pack_sequences, tokenize,
)
from ..reference.evaluate import greedy_agreement, perplexity, token_forward_seconds
from ..reference.sources import MAX_FILE_BYTES
from .depth_growth import grow_depth
from .reference_presets import MODEL_PRESETS, TrainRecipe
from .reference_tokenizer import (CHAT_TEMPLATE, DEFAULT_VOCAB_SIZE, RESPONSE_TEMPLATE, save_tokenizer,
                                  train_tokenizer)
from .reference_trainer import Checkpointing, build_model, num_parameters, save_model, train_model

EVAL_SEQ_LEN = 512
EVAL_ROWS = 128  # per held-out split, evenly spaced over its packed rows
HELD_OUT_SPLITS = ("held_out", "held_out_packages")
COST_CONTEXT = 128  # tokens of KV cache behind the timed single-token forwards


def prepare_tokenizer(
    out: Path, train_texts: list[str], retrain: bool, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> tuple[PreTrainedTokenizerBase, float | None]:
    """The tokenizer in ``out/tokenizer``, trained and saved there first if absent or ``retrain``; returns it and
    its training time in seconds (``None`` when reused)."""
    folder = out / "tokenizer"
    if (folder / "tokenizer.json").is_file() and not retrain:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if tokenizer.chat_template != CHAT_TEMPLATE or tokenizer.response_template != RESPONSE_TEMPLATE:
            tokenizer.chat_template = CHAT_TEMPLATE  # a tokenizer saved before the templates changed
            tokenizer.response_template = RESPONSE_TEMPLATE
            save_tokenizer(tokenizer, folder)
        return tokenizer, None
    start = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, vocab_size)
    seconds = time.perf_counter() - start
    save_tokenizer(tokenizer, folder)
    return tokenizer, seconds


def evaluation_rows(token_ids: list[list[int]], separator_id: int, max_rows: int = EVAL_ROWS) -> torch.Tensor:
    """``[<= max_rows, EVAL_SEQ_LEN]`` rows of a packed split, evenly spaced over it (all rows if fewer)."""
    rows = pack_sequences(token_ids, separator_id, EVAL_SEQ_LEN)
    if len(rows) <= max_rows:
        return rows
    return rows[torch.linspace(0, len(rows) - 1, max_rows).round().long()]


def _corpus_record(corpus: SplitCorpus, token_counts: dict[str, int]) -> dict:
    def split_record(split: Corpus, tokens: int) -> dict:
        return {"files": split.num_files, "bytes": split.num_bytes, "tokens": tokens, "fingerprint": split.fingerprint}

    return {
        "rules": {"held_out_percent": HELD_OUT_PERCENT, "near_dup_share": NEAR_DUP_SHARE,
                  "near_dup_min_lines": NEAR_DUP_MIN_LINES, "near_dup_line_chars": NEAR_DUP_LINE_CHARS,
                  "max_file_bytes": MAX_FILE_BYTES, "eval_rows": EVAL_ROWS, "eval_seq_len": EVAL_SEQ_LEN},
        "splits": {name: split_record(split, token_counts[name]) for name, split in corpus.splits.items()},
        "sources": [asdict(record) for record in corpus.sources],
    }


def held_out_perplexities(model: torch.nn.Module, eval_rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """Perplexity of ``model`` on each held-out split's evaluation rows."""
    return {split: round(perplexity(model, rows), 3) for split, rows in eval_rows.items()}


def initial_model(name: str, tokenizer: PreTrainedTokenizerBase, seed: int, grow_from: Path | None) -> torch.nn.Module:
    """A fresh seeded model of ``name``'s preset, or, with ``grow_from`` (an assets folder), that folder's trained
    ``name`` grown to the preset's depth (see ``depth_growth.grow_depth``)."""
    preset = MODEL_PRESETS[name]
    if grow_from is None:
        return build_model(preset, tokenizer, seed)
    trained, _ = load(name, assets_dir=grow_from)
    shape = (trained.config.hidden_size, trained.config.intermediate_size, trained.config.num_attention_heads)
    if shape != (preset.hidden_size, preset.intermediate_size, preset.num_heads):
        raise ValueError(f"grow_from: {grow_from / name} has (hidden, intermediate, heads) {shape}; the {name!r} "
                         f"preset needs ({preset.hidden_size}, {preset.intermediate_size}, {preset.num_heads})")
    return grow_depth(trained, preset.num_layers)


@dataclass(frozen=True, slots=True)
class TrainStart:
    """Where a model's training starts and what it learns from. Default: a fresh seeded model learning the text.
    ``grow_from``: an assets folder whose trained model of the same name is grown to the preset's depth
    (``initial_model``), and ``skip_batches`` batches of the seeded order passed over (the rows it saw);
    ``distill_from``: an assets folder whose target is the teacher (``reference_trainer.train_model``)."""

    grow_from: Path | None = None
    skip_batches: int = 0
    distill_from: Path | None = None

    def record(self, name: str) -> dict:
        """The fields that differ from a fresh start, for report.json; `earlier`: model `name`'s training record in
        the `grow_from` folder's report.json (its own earlier stages inside), so the card can total every stage."""
        fields = {"grow_from": self.grow_from, "skip_batches": self.skip_batches, "distill_from": self.distill_from}
        record = {key: str(value) if isinstance(value, Path) else value for key, value in fields.items() if value}
        report = self.grow_from / "report.json" if self.grow_from is not None else None
        if report is not None and report.is_file():
            earlier = json.loads(report.read_text()).get("models", {}).get(name)
            if earlier is not None:
                record["earlier"] = earlier
        return record


def train_one(name: str, recipe: TrainRecipe, tokenizer: PreTrainedTokenizerBase, train_ids: list[list[int]],
              out: Path, time_budget_s: float | None, progress: bool, checkpointing: Checkpointing | None,
              start: TrainStart = TrainStart()) -> dict:
    """Train ``name`` on the train ids and save it to ``out/name``; returns its training record (no perplexity
    yet: ``measure`` adds it from the saved files)."""
    rows = pack_sequences(train_ids, tokenizer.eos_token_id, recipe.seq_len)
    model = initial_model(name, tokenizer, recipe.seed, start.grow_from)
    teacher = None if start.distill_from is None else load("target", assets_dir=start.distill_from)[0]
    result = train_model(model, rows, recipe, time_budget_s, progress, checkpointing, start.skip_batches, teacher)
    save_model(model, tokenizer, out / name)
    started = start.record(name)
    return {
        **({"start": started} if started else {}),
        "parameters": num_parameters(model),
        "preset": asdict(MODEL_PRESETS[name]),
        "recipe": asdict(recipe),
        "steps_done": result.steps_done,
        "train_seconds": round(result.seconds, 1),
        "tokens_seen": result.tokens_seen,
        "epochs": round(result.tokens_seen / rows.numel(), 3),
        "final_train_loss": round(result.final_loss(), 4),
    }


def measure(out: Path, eval_rows: dict[str, torch.Tensor], baseline: Path | None) -> dict:
    """Held-out perplexities of the saved models in ``out`` (reloaded from their bf16 files), of the baseline target
    in ``baseline`` if given, and the draft's greedy agreement with the target on the by-package split."""
    found = {name: load(name, assets_dir=out)[0] for name in MODEL_NAMES if (out / name / "config.json").is_file()}
    measured: dict = {"perplexity": {name: held_out_perplexities(m, eval_rows) for name, m in found.items()}}
    if baseline is not None:
        old, _ = load("target", assets_dir=baseline)
        measured["baseline_target"] = {"parameters": num_parameters(old), "folder": str(baseline),
                                       "held_out_perplexity": held_out_perplexities(old, eval_rows)}
    if len(found) == len(MODEL_NAMES):
        rows = eval_rows["held_out_packages"]
        measured["greedy_agreement"] = round(greedy_agreement(found["draft"], found["target"], rows), 4)
        target_s, draft_s = token_forward_seconds(found["target"], found["draft"], rows[:1, :COST_CONTEXT])
        measured["token_forward_ms"] = {"target": round(1e3 * target_s, 3), "draft": round(1e3 * draft_s, 3),
                                        "context": COST_CONTEXT, "threads": torch.get_num_threads()}
    return measured


def build_reference(
    names: Sequence[str],
    recipes: dict[str, TrainRecipe],
    out: Path | None = None,
    time_budget_s: float | None = None,
    retrain_tokenizer: bool = False,
    progress: bool = True,
    checkpointing: dict[str, Checkpointing] | None = None,
    baseline: Path | None = None,
    start: TrainStart = TrainStart(),
) -> Path:
    """Run the pipeline for ``names`` (a subset of "target", "draft"; empty: only measure what is in ``out``) into
    ``out`` (default: the package's assets), each model starting as ``start`` says; returns the path of the written
    ``report.json``."""
    out = ASSETS_DIR if out is None else Path(out)
    corpus = default_corpus()
    tokenizer, tokenizer_seconds = prepare_tokenizer(out, corpus.splits["train"].texts, retrain_tokenizer)
    known = _known_token_counts(_previous_report(out), corpus) if not names and tokenizer_seconds is None else {}
    token_ids = {split: tokenize(c.texts, tokenizer) for split, c in corpus.splits.items() if split not in known}
    token_counts = {**known, **{split: sum(len(ids) for ids in token_ids[split]) for split in token_ids}}
    eval_rows = {split: evaluation_rows(token_ids[split], tokenizer.eos_token_id) for split in HELD_OUT_SPLITS}
    trained = {name: train_one(name, recipes[name], tokenizer, token_ids["train"], out, time_budget_s, progress,
                               (checkpointing or {}).get(name), start) for name in names}
    for record in trained.values():  # which corpus a model saw: the card tells models of an earlier corpus apart
        record["train_fingerprint"] = corpus.splits["train"].fingerprint
    for name in MODEL_NAMES:  # every saved model carries the current tokenizer files (chat template included)
        if (out / name / "config.json").is_file():
            save_tokenizer(tokenizer, out / name)
    measured = measure(out, eval_rows, baseline)
    report = _updated_report(_previous_report(out), _corpus_record(corpus, token_counts), trained, measured)
    report.setdefault("tokenizer", {})["vocab_size"] = len(tokenizer)
    if tokenizer_seconds is not None:
        report["tokenizer"]["train_seconds"] = round(tokenizer_seconds, 1)
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def _updated_report(report: dict, corpus_record: dict, trained: dict, measured: dict) -> dict:
    """The earlier report with this run's corpus, training records and measurements in place."""
    report.update(python=platform.python_version(), corpus=corpus_record,
                  torch={"version": torch.__version__, "threads": torch.get_num_threads()})
    models = report.setdefault("models", {})
    models.update(trained)
    for name, perplexities in measured["perplexity"].items():
        models.setdefault(name, {})["held_out_perplexity"] = perplexities
    for key in ("baseline_target", "greedy_agreement", "token_forward_ms"):
        if key in measured:
            report[key] = measured[key]
    return report


def _known_token_counts(report: dict, corpus: SplitCorpus) -> dict[str, int]:
    """The train split's token count from an earlier report of the same corpus (equal fingerprint), for a
    measure-only run that did not retrain the tokenizer: it need not tokenize text it does not evaluate."""
    previous = report.get("corpus", {}).get("splits", {}).get("train", {})
    if previous.get("fingerprint") == corpus.splits["train"].fingerprint and "tokens" in previous:
        return {"train": previous["tokens"]}
    return {}


def _previous_report(out: Path) -> dict:
    path = out / "report.json"
    return json.loads(path.read_text()) if path.is_file() else {}
