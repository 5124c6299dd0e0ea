"""A folder vLLM serves as it is: the model (bf16, or int8 / int4 weight-only compressed-tensors), its tokenizer and
generation config, optional Medusa heads in vLLM's layout under `medusa/`, and `serve.sh` / `README.md` with the
exact `vllm serve` command line.

    from hf_accel.export import export_vllm
    export_vllm("out/target-int4", quant="int4")     # the reference target with the reference Medusa heads
    # then, on a GPU machine with vLLM 0.32.0:  bash out/target-int4/serve.sh

Targeted: vLLM 0.32.0, the last release with Medusa (0.33.0 removed it); it pins compressed-tensors 0.17.0, the
version hf_accel writes with. Config fields and source lines are in docs/export.md.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..engine.limits import context_length
from ..speculative.medusa_heads import MedusaHeads
from .medusa import export_vllm as export_medusa

VLLM_VERSION = "0.32.0"
REFERENCE_MODEL_DIR = reference.ASSETS_DIR / "target"
REFERENCE_MEDUSA_DIR = reference.ASSETS_DIR / "medusa"
MEDUSA_SUBDIR = "medusa"
EXPORT_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """What `vllm serve` needs to know about an exported folder."""

    served_model_name: str
    max_model_len: int
    quantized: bool
    num_speculative_tokens: int | None  # Medusa heads exported: one token per head; None: no heads

    def argv(self, folder: str) -> list[str]:
        """`vllm serve` arguments for the export in `folder` (a path or a shell expression such as `$HERE`)."""
        args = ["vllm", "serve", folder, "--served-model-name", self.served_model_name,
                "--max-model-len", str(self.max_model_len)]
        if self.quantized:  # vLLM also detects it from config.json's quantization_config; stated for clarity
            args += ["--quantization", "compressed-tensors"]
        if self.num_speculative_tokens is not None:
            spec = {"method": "medusa", "model": f"{folder}/{MEDUSA_SUBDIR}",
                    "num_speculative_tokens": self.num_speculative_tokens}
            args += ["--speculative-config", json.dumps(spec)]
        return args

    def command_line(self, folder: Path) -> str:
        """The command for `folder` as one shell-quoted line."""
        return shlex.join(self.argv(str(folder)))

    def script(self) -> str:
        """`serve.sh`: the same command for the folder the script sits in, extra arguments passed through."""
        here = "__HERE__"
        line = " ".join(_quote_with_here(arg, here) for arg in self.argv(here))
        return ("#!/usr/bin/env bash\n"
                f"# Serve this folder with vLLM {VLLM_VERSION} (written by `hf-accel export`); extra arguments go to "
                "`vllm serve`.\nset -euo pipefail\n"
                'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
                f'exec {line} "$@"\n')


def _quote_with_here(arg: str, here: str) -> str:
    # double quotes so that "$HERE" expands; JSON's own quotes are escaped
    if here not in arg:
        return shlex.quote(arg)
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
    return '"' + escaped.replace(here, "${HERE}") + '"'


def check_output(out: Path, overwrite: bool) -> None:
    """`ValueError` naming `out` when it is a file, or a non-empty folder and `overwrite` is not set."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out {str(out)!r} exists and is not empty; pass --overwrite (overwrite=True) to write "
                         "into it")


def check_model_folder(model_path: Path) -> None:
    """`ValueError` naming `model` unless `model_path` is a local folder with a `config.json`."""
    if not (model_path / "config.json").is_file():
        raise ValueError(f"model {str(model_path)!r} is not a local model folder (no config.json in it)")


def resolve_medusa(model_path: Path, medusa: Path | None) -> Path | None:
    """`medusa` when given, else the reference heads when `model_path` is the reference target, else None."""
    if medusa is not None:
        return medusa
    return REFERENCE_MEDUSA_DIR if model_path.resolve() == REFERENCE_MODEL_DIR.resolve() else None


def load_heads(medusa: Path, model: PreTrainedModel) -> MedusaHeads:
    """The heads saved in `medusa`, checked against `model`; `ValueError` naming `medusa` when they do not fit."""
    try:
        heads = MedusaHeads.from_pretrained(medusa, dtype=EXPORT_DTYPE)
    except FileNotFoundError as error:
        raise ValueError(f"medusa {str(medusa)!r} is not a Medusa heads folder: {error}") from None
    heads.check_compatible(model)
    return heads


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model; `ValueError` naming `model` when the folder has none (vLLM needs one)."""
    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"model {str(model_path)!r} has no tokenizer files vLLM could load: {error}") from None


def write_readme(out: Path, command: ServeCommand, quant: str | None, source: str) -> None:
    weights_line = {None: "bf16 safetensors (a standard transformers folder)",
                    "int8": "int8 weight-only, compressed-tensors `pack-quantized`, one scale per output channel",
                    "int4": "int4 weight-only, compressed-tensors `pack-quantized`, symmetric, grouped"}[quant]
    medusa = (f"- `{MEDUSA_SUBDIR}/`: Medusa heads in vLLM's layout ({command.num_speculative_tokens} heads)\n"
              if command.num_speculative_tokens is not None else "")
    out.joinpath("README.md").write_text(
        f"# {command.served_model_name}\n\nExported by `hf-accel export --format vllm` from {source}, for vLLM "
        f"{VLLM_VERSION}.\n\n- weights: {weights_line}\n- tokenizer and generation config\n{medusa}"
        "\n## Serve\n\n```bash\nbash serve.sh            # extra arguments go to `vllm serve`\n```\n\n"
        f"which runs, for this folder:\n\n```bash\n{command.command_line(out.resolve())}\n```\n\n"
        "The folder also loads in transformers: `AutoModelForCausalLM.from_pretrained(folder)` (quantized exports "
        "need `pip install compressed-tensors`).\n")


def export_vllm(out: str | Path, model: str | Path | None = None, quant: str | None = None,
                medusa: str | Path | None = None, served_model_name: str | None = None,
                overwrite: bool = False) -> Path:
    """Write a vLLM-ready folder to `out` and return it.

    `model`: a local model folder (default: hf_accel's reference target). `quant`: None (bf16), "int8" or "int4".
    `medusa`: a Medusa heads folder (`MedusaHeads.save_pretrained`; default: the reference heads when exporting the
    reference target). `served_model_name` defaults to `out`'s folder name. Bad input raises `ValueError` naming
    the argument before anything is written; a `quant` without compressed-tensors installed, `ModuleNotFoundError`.
    """
    if quant is not None:  # compressed-tensors (the `export` extra) is needed for quantized exports only
        from .compressed import export_quant, quantization_config, save_compressed
    scheme = None if quant is None else export_quant(quant)
    model_path = REFERENCE_MODEL_DIR if model is None else Path(model)
    check_model_folder(model_path)
    out = Path(out)
    check_output(out, overwrite)
    tokenizer = load_tokenizer(model_path)
    loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=EXPORT_DTYPE, local_files_only=True).eval()
    config = None if scheme is None else quantization_config(loaded, scheme)  # checks the group size first
    medusa_path = resolve_medusa(model_path, None if medusa is None else Path(medusa))
    heads = None if medusa_path is None else load_heads(medusa_path, loaded)
    command = ServeCommand(served_model_name or out.resolve().name, context_length(loaded), scheme is not None,
                           None if heads is None else heads.num_heads)
    out.mkdir(parents=True, exist_ok=True)
    if config is None:
        loaded.save_pretrained(out)
    else:
        save_compressed(loaded, config, out)
    tokenizer.save_pretrained(out)
    if heads is not None:
        export_medusa(heads, out / MEDUSA_SUBDIR, EXPORT_DTYPE)
    script = out / "serve.sh"
    script.write_text(command.script())
    script.chmod(0o755)
    write_readme(out, command, quant, "the hf_accel reference target" if model is None else str(model_path))
    return out
