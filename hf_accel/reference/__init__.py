"""hf_accel's own small reference models: a Llama target and a smaller draft, trained on Python source.

    from hf_accel import reference
    model, tokenizer = reference.load("target")   # or "draft"; plain from_pretrained on a local folder
    head = reference.load_head("eagle", model)     # or "medusa": the target's trained speculative heads

Both share one byte-level BPE tokenizer. This package holds the shipped assets and what reads them: loading
(``load``, ``load_head``), the corpus the models were trained on and its held-out splits (``corpus.py``,
``sources.py``), the held-out text shipped for benchmarks (``held_out.py``) and held-out metrics (``evaluate.py``).
It imports no training code: ``hf-accel train-reference`` (``hf_accel.training.reference_command``) creates the
assets; docs/reference-models.md is their model card.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..speculative.eagle_head import EagleHead
from ..speculative.medusa_heads import MedusaHeads
from .corpus import Split, load_split, pack_sequences, tokenize
from .held_out import shipped_text

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
MODEL_NAMES = ("target", "draft")
HEAD_NAMES = ("eagle", "medusa")
HEAD_COMMANDS = {"eagle": "hf-accel train-eagle", "medusa": "hf-accel train-medusa"}
TRAIN_COMMAND = "hf-accel train-reference (or: python -m hf_accel.training.reference_command)"


def load(
    name: str, dtype: torch.dtype = torch.float32, assets_dir: Path = ASSETS_DIR
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of the reference model ``name`` ("target" or "draft"), loaded offline from
    ``assets_dir/name`` in eval mode.

    The weights are stored in bf16; ``dtype`` (default fp32, exact upcast) is the dtype the model computes in.
    Raises ``FileNotFoundError`` naming the command that creates the assets when they are missing.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"name must be one of {MODEL_NAMES}, got {name!r}")
    folder = Path(assets_dir) / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"reference model {name!r} not found in {folder}; create it with: {TRAIN_COMMAND}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer


def load_head(
    name: str, model: PreTrainedModel | None = None, dtype: torch.dtype = torch.float32, assets_dir: Path = ASSETS_DIR
) -> EagleHead | MedusaHeads:
    """The reference target's trained speculative heads: ``"eagle"`` (an ``EagleHead`` for ``model``, default a
    freshly loaded reference target; pass the target you decode with) or ``"medusa"`` (``MedusaHeads``), from
    ``assets_dir/name``, computing in ``dtype`` (stored in bf16; default fp32, an exact upcast).

    Raises ``ValueError`` for another name and ``FileNotFoundError`` naming the command that trains missing heads.
    """
    if name not in HEAD_NAMES:
        raise ValueError(f"name must be one of {HEAD_NAMES}, got {name!r}")
    folder = Path(assets_dir) / name
    if not any(folder.glob("*_config.json")):
        raise FileNotFoundError(f"reference {name} heads not found in {folder}; train them with: "
                                f"{HEAD_COMMANDS[name]}")
    if name == "medusa":
        return MedusaHeads.from_pretrained(folder, dtype=dtype)
    return EagleHead.from_pretrained(folder, model if model is not None else load("target")[0], dtype=dtype)


def has_assets(assets_dir: Path = ASSETS_DIR) -> bool:
    """Whether both reference models are present in ``assets_dir``."""
    return all((Path(assets_dir) / name / "config.json").is_file() for name in MODEL_NAMES)


def held_out_sequences(
    tokenizer: PreTrainedTokenizerBase, seq_len: int = 512, max_rows: int | None = None,
    split: Split = "held_out",
) -> torch.Tensor:
    """A held-out split (never trained on) as ``[rows, seq_len]`` token ids: files in corpus order, each followed by
    the end-of-text token, cut into rows; at most ``max_rows`` rows (all by default).

    ``split`` "held_out" (the benchmarks' prompts) reads the text shipped in the package, the same on every install:
    the standard library's held-out files (``held_out.shipped_text``, about 77k tokens of the reference tokenizer),
    the first files of the corpus split of that name, so its rows are that split's first rows. "held_out_packages"
    (whole packages never trained on) is built from the installed corpus sources: it needs the ``dev`` extra.
    """
    if split == "held_out":
        texts = shipped_text().texts
    elif split == "held_out_packages":
        texts = load_split(split).texts
    else:
        raise ValueError(f"split must be 'held_out' or 'held_out_packages', got {split!r}")
    rows = pack_sequences(tokenize(texts, tokenizer), tokenizer.eos_token_id, seq_len)
    return rows if max_rows is None else rows[:max_rows]


__all__ = ["ASSETS_DIR", "HEAD_NAMES", "MODEL_NAMES", "has_assets", "held_out_sequences", "load", "load_head"]
