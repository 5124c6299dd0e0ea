"""A folder vLLM serves as it is: the model (bf16, or int8 / int4 weight-only compressed-tensors), its tokenizer and
generation config, optional draft heads in vLLM's layouts (an EAGLE-3 head under `eagle3/`, Medusa heads under
`medusa/`), optional peft LoRA adapters under `loras/NAME/`, and `serve.sh` / `README.md` with the exact `vllm serve`
command line (speculating with one of the heads, or serving the adapters with `--enable-lora`).

    from hf_accel.export import export_vllm
    export_vllm("out/target-int4", quant="int4")     # the reference target with the reference EAGLE and Medusa heads
    # then, on a GPU machine with vLLM 0.32.0:  bash out/target-int4/serve.sh

Targeted: vLLM 0.32.0, the last release with Medusa (0.33.0 removed it); it pins compressed-tensors 0.17.0, the
version hf_accel writes with. Config fields and source lines are in docs/export.md.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..engine.limits import context_length
from ..speculative.eagle_head import EagleHead
from ..speculative.medusa_heads import MedusaHeads
from .vllm_eagle import check_exportable
from .vllm_eagle import export_vllm as export_eagle
from .vllm_lora import LoRAModules
from .vllm_medusa import export_vllm as export_medusa

VLLM_VERSION = "0.32.0"
REFERENCE_MODEL_DIR = reference.ASSETS_DIR / "target"
REFERENCE_HEAD_DIRS = {"eagle3": reference.ASSETS_DIR / "eagle", "medusa": reference.ASSETS_DIR / "medusa"}
HEAD_SUBDIRS = {"eagle3": "eagle3", "medusa": "medusa"}  # vLLM's method name -> folder inside the export
SPECULATIVE_CHOICES = ("eagle3", "medusa", "none")
EAGLE_SPECULATIVE_TOKENS = 5  # vLLM drafts a fixed chain; eagle_generate's adaptive chains average 4.6 here
EXPORT_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """What `vllm serve` needs to know about an exported folder."""

    served_model_name: str
    max_model_len: int
    quantized: bool
    speculative_method: str | None  # "eagle3" or "medusa": the heads `vllm serve` speculates with; None: none
    num_speculative_tokens: int | None = None  # Medusa: one token per head; EAGLE-3: the chain length
    lora: LoRAModules | None = None  # adapters served with --enable-lora

    def argv(self, folder: str) -> list[str]:
        """`vllm serve` arguments for the export in `folder` (a path or a shell expression such as `$HERE`)."""
        args = ["vllm", "serve", folder, "--served-model-name", self.served_model_name,
                "--max-model-len", str(self.max_model_len)]
        if self.quantized:  # vLLM also detects it from config.json's quantization_config; stated for clarity
            args += ["--quantization", "compressed-tensors"]
        if self.lora is not None:
            args += self.lora.argv(folder)
        if self.speculative_method is not None:
            spec = {"method": self.speculative_method, "model": f"{folder}/{HEAD_SUBDIRS[self.speculative_method]}",
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


def resolve_heads(model_path: Path, method: str, given: Path | None) -> Path | None:
    """`given` when set, else the reference heads of `method` ("eagle3" / "medusa") when `model_path` is the
    reference target, else None."""
    if given is not None:
        return given
    return REFERENCE_HEAD_DIRS[method] if model_path.resolve() == REFERENCE_MODEL_DIR.resolve() else None


def load_eagle(eagle: Path, model: PreTrainedModel) -> EagleHead:
    """The EAGLE head saved in `eagle` for `model`, checked exportable; `ValueError` naming `eagle` otherwise."""
    try:
        head = EagleHead.from_pretrained(eagle, model, dtype=EXPORT_DTYPE)
    except FileNotFoundError as error:
        raise ValueError(f"eagle {str(eagle)!r} is not an EAGLE head folder: {error}") from None
    except ValueError as error:
        raise ValueError(f"eagle {str(eagle)!r}: {error}") from None
    check_exportable(head)
    return head


def check_speculative(speculative: str | None) -> None:
    """`ValueError` naming `speculative` unless it is None or one of `SPECULATIVE_CHOICES`."""
    if speculative is not None and speculative not in SPECULATIVE_CHOICES:
        raise ValueError(f"speculative must be one of {', '.join(map(repr, SPECULATIVE_CHOICES))}, got {speculative!r}")


def serving_method(speculative: str | None, eagle: EagleHead | None, heads: MedusaHeads | None) -> str | None:
    """The method `serve.sh` speculates with: `speculative` when given ("none": no speculation), else EAGLE-3 when
    a head is exported, else Medusa when heads are; `ValueError` naming `speculative` for a method without heads."""
    check_speculative(speculative)
    available = {"eagle3": eagle is not None, "medusa": heads is not None}
    if speculative is None:
        return next((method for method, present in available.items() if present), None)
    if speculative != "none" and not available[speculative]:
        flag = "eagle" if speculative == "eagle3" else "medusa"
        raise ValueError(f"speculative={speculative!r} needs {flag} heads to export: pass {flag}=<folder>")
    return None if speculative == "none" else speculative


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


def write_readme(out: Path, command: ServeCommand, quant: str | None, source: str,
                 parts: list[tuple[str, str]]) -> None:
    """`README.md`: what `out` holds (`parts`: (folder, description) of its heads and adapters) and how to serve it."""
    weights_line = {None: "bf16 safetensors (a standard transformers folder)",
                    "int8": "int8 weight-only, compressed-tensors `pack-quantized`, one scale per output channel",
                    "int4": "int4 weight-only, compressed-tensors `pack-quantized`, symmetric, grouped"}[quant]
    listed = "".join(f"- `{subdir}/`: {description}\n" for subdir, description in parts)
    out.joinpath("README.md").write_text(
        f"# {command.served_model_name}\n\nExported by `hf-accel export --format vllm` from {source}, for vLLM "
        f"{VLLM_VERSION}.\n\n- weights: {weights_line}\n- tokenizer and generation config\n{listed}"
        "\n## Serve\n\n```bash\nbash serve.sh            # extra arguments go to `vllm serve`\n```\n\n"
        f"which runs, for this folder:\n\n```bash\n{command.command_line(out.resolve())}\n```\n\n"
        "The folder also loads in transformers: `AutoModelForCausalLM.from_pretrained(folder)` (quantized exports "
        "need `pip install compressed-tensors`).\n")


@dataclass(frozen=True, slots=True)
class DraftHeads:
    """The draft heads an export carries: an EAGLE head (under `eagle3/`) and Medusa heads (under `medusa/`)."""

    eagle: EagleHead | None
    medusa: MedusaHeads | None

    @classmethod
    def load(cls, model_path: Path, model: PreTrainedModel, eagle: str | Path | None,
             medusa: str | Path | None) -> DraftHeads:
        """The heads given (or the reference heads for the reference target), checked against `model`."""
        eagle_path = resolve_heads(model_path, "eagle3", None if eagle is None else Path(eagle))
        medusa_path = resolve_heads(model_path, "medusa", None if medusa is None else Path(medusa))
        return cls(None if eagle_path is None else load_eagle(eagle_path, model),
                   None if medusa_path is None else load_heads(medusa_path, model))

    def num_speculative_tokens(self, method: str | None) -> int | None:
        """What `vllm serve` drafts per step with `method`: EAGLE-3's chain length, or one token per Medusa head."""
        per_step = {"eagle3": EAGLE_SPECULATIVE_TOKENS, "medusa": self.medusa.num_heads if self.medusa else None}
        return per_step.get(method)

    def write(self, out: Path) -> list[tuple[str, str]]:
        """Write the heads into their folders under `out`; (folder, description) of each, for the README."""
        written = []
        if self.eagle is not None:
            export_eagle(self.eagle, out / HEAD_SUBDIRS["eagle3"], EXPORT_DTYPE)
            written.append((HEAD_SUBDIRS["eagle3"], 'an EAGLE-3 draft head in vLLM\'s layout (`"method": "eagle3"`)'))
        if self.medusa is not None:
            export_medusa(self.medusa, out / HEAD_SUBDIRS["medusa"], EXPORT_DTYPE)
            written.append((HEAD_SUBDIRS["medusa"], f"Medusa heads in vLLM's layout ({self.medusa.num_heads} heads, "
                                                     '`"method": "medusa"`)'))
        return written


def _export_scheme(quant: str | None, lora_modules: Mapping[str, str | Path] | None) -> Any:
    """The compressed-tensors scheme of `quant` (None: bf16 weights); ValueError for adapters with `quant`.
    compressed-tensors (the `export` extra) is imported for quantized exports only."""
    if quant is None:
        return None
    if lora_modules:
        raise ValueError(f"lora_modules cannot be exported with quant={quant!r}: vLLM serving LoRA over "
                         "compressed-tensors weights is not verified (vLLM 0.32's CPU build loads no int8 export; "
                         "see docs/export.md); export bf16 weights with the adapters")
    from .compressed import export_quant

    return export_quant(quant)


def _write_folder(out: Path, model: PreTrainedModel, config: Any, tokenizer: PreTrainedTokenizerBase,
                  command: ServeCommand) -> None:
    """The model (bf16, or compressed with `config`), its tokenizer and `serve.sh` written to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if config is None:
        model.save_pretrained(out)
    else:
        from .compressed import save_compressed

        save_compressed(model, config, out)
    tokenizer.save_pretrained(out)
    script = out / "serve.sh"
    script.write_text(command.script())
    script.chmod(0o755)


def export_vllm(out: str | Path, model: str | Path | None = None, quant: str | None = None,
                medusa: str | Path | None = None, eagle: str | Path | None = None, speculative: str | None = None,
                served_model_name: str | None = None, overwrite: bool = False,
                lora_modules: Mapping[str, str | Path] | None = None) -> Path:
    """Write a vLLM-ready folder to `out` and return it.

    `model`: a local model folder (default: hf_accel's reference target). `quant`: None (bf16), "int8" or "int4".
    `eagle`: an EAGLE head folder (`EagleHead.save_pretrained`), written under `eagle3/` as vLLM's EAGLE-3 draft;
    `medusa`: a Medusa heads folder (`MedusaHeads.save_pretrained`), written under `medusa/`; each defaults to the
    reference heads when exporting the reference target. `speculative`: what `serve.sh` speculates with, "eagle3",
    "medusa" or "none" (default: "eagle3" when an EAGLE head is exported, else "medusa" when heads are).
    `served_model_name` defaults to `out`'s folder name. `lora_modules`: name -> peft LoRA adapter folder, each
    checked against the model and copied under `loras/NAME/`, served with `--enable-lora` (then `speculative`
    defaults to "none"; not with `quant`: vLLM's LoRA over compressed-tensors weights is unverified here). Bad
    input raises `ValueError` naming the argument before anything is written; a `quant` without compressed-tensors
    installed, `ModuleNotFoundError`.
    """
    scheme = _export_scheme(quant, lora_modules)
    check_speculative(speculative)
    model_path = REFERENCE_MODEL_DIR if model is None else Path(model)
    check_model_folder(model_path)
    out = Path(out)
    check_output(out, overwrite)
    tokenizer = load_tokenizer(model_path)
    loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=EXPORT_DTYPE, local_files_only=True).eval()
    config = None if scheme is None else _quantization_config(loaded, scheme)  # checks the group size first
    drafts = DraftHeads.load(model_path, loaded, eagle, medusa)
    served_name = served_model_name or out.resolve().name
    adapters = None if not lora_modules else LoRAModules.check(lora_modules, loaded, served_name)
    # the heads draft the base's tokens, not an adapter's: with adapters, speculation only when asked for
    method = serving_method("none" if adapters and speculative is None else speculative, drafts.eagle, drafts.medusa)
    command = ServeCommand(served_name, context_length(loaded), scheme is not None, method,
                           drafts.num_speculative_tokens(method), adapters)
    _write_folder(out, loaded, config, tokenizer, command)
    written = drafts.write(out) + ([] if adapters is None else adapters.write(out))
    write_readme(out, command, quant, "the hf_accel reference target" if model is None else str(model_path), written)
    return out


def _quantization_config(model: PreTrainedModel, scheme: Any) -> Any:
    """compressed-tensors' config for `model` under `scheme` (imported here: the extra is needed only to quantize)."""
    from .compressed import quantization_config

    return quantization_config(model, scheme)
