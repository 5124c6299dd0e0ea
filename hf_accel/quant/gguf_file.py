"""GGUF in, kept packed: a llama.cpp model file loaded as a transformers model whose Q8_0 / Q4_0 Linears stay in their
codes and run on hf_accel's quantized kernels (transformers' own `gguf_file=` loader dequantizes every tensor to
float, which reads 4-8x the bytes per token).

    model = hf_accel.load_model("model-Q4_0.gguf")          # or load_gguf(path, dtype=torch.bfloat16)
    tokenizer = hf_accel.load_tokenizer("model-Q4_0.gguf")  # the one the file holds, read by transformers

The mapping is exact, block for block (32 inputs per GGUF block):
- Q8_0 (fp16 `d`, 32 int8 `q`; `w = q * d`) -> `Int8Linear(group_size=32)`: codes `q`, scale `d`.
- Q4_0 (fp16 `d`, 16 bytes: input j in the low nibble of byte j, input j + 16 in the high; `w = (q - 8) * d`) ->
  `Int4Linear(group_size=32)`: codes `q`, (scale, zero) = (`d`, 0).
The file loads as an hf_accel pre-quantized checkpoint (`WeightOnlyConfig` of the more common type, the other type's
Linears and a packed output layer named in `module_formats`), so `save_pretrained` keeps the mix as it is. Every other
tensor type (F32, F16, BF16, and the K-quants such as Q6_K, which llama-quantize gives the output or embedding of a
Q4_0 file) is dequantized by the `gguf` package into the model's dtype. llama.cpp's converter interleaves the rows of
Llama's q / k projections for its rotary layout; they are put back here (rows only, so the codes are untouched).
Architectures: llama (Mistral files say llama too), qwen2, qwen3. Config comes from transformers' GGUF reader.
"""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from . import weights
from .quantizer import WeightOnlyConfig

BLOCK = 32  # inputs per Q8_0 / Q4_0 block
PACKED_TYPES = {"Q8_0": 8, "Q4_0": 4}  # GGML type name -> bits of the hf_accel module that keeps it
ARCHITECTURES = ("llama", "qwen2", "qwen3")
OUTPUT = "lm_head"  # the output layer of every architecture above
ROTARY_INTERLEAVED = {"llama"}  # converters that interleave q / k rows (convert_hf_to_gguf's LlamaModel.permute)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> PreTrainedModel:
    """The causal LM in the GGUF file `path`, its Q8_0 / Q4_0 Linears kept packed (see the module docstring); other
    tensors in `dtype`. `kwargs` go to `from_pretrained` (e.g. `attn_implementation`). `ValueError` for a file that
    is not GGUF, an architecture outside `ARCHITECTURES`, or a tensor the model does not have or lacks."""
    path = Path(path)
    reader = _reader(path)
    architecture = str(reader.fields["general.architecture"].contents())
    if architecture not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.tie_word_embeddings = "output.weight" not in tensors
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = _tensor_names(skeleton, architecture, tensors)
    linears = _linear_kinds(skeleton, names, tensors)
    main = _main_kind(linears)
    state: dict[str, torch.Tensor] = {}
    for key, name in names.items():
        module_name, _, leaf = key.rpartition(".")
        rows = _row_order(key, config, architecture)
        if leaf == "weight" and linears.get(module_name) in PACKED_TYPES:
            state.update(_packed_state(module_name, tensors[name], rows))
        else:
            state[key] = _dequantized(tensors[name], rows, dtype)
    if main is not None:
        config.quantization_config = _quantization_config(main, linears).to_dict()
    model, info = type(skeleton).from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                 output_loading_info=True, **kwargs)
    problems = {key: sorted(info[key]) for key in ("missing_keys", "mismatched_keys", "unexpected_keys") if info[key]}
    if problems:  # a mapping error here would otherwise leave random weights behind a warning
        raise ValueError(f"GGUF file {str(path)!r} did not load cleanly: {problems}")
    return model.eval()


def _quantization_config(main: str, linears: dict[str, str]) -> WeightOnlyConfig:
    """hf_accel's checkpoint config for these Linears: `main`'s format for the decoder's, the other packed type (and
    a packed output layer) by name, every other Linear float."""
    floats = [name for name, kind in linears.items() if kind not in PACKED_TYPES]
    named = {name: {"bits": PACKED_TYPES[kind], "group_size": BLOCK} for name, kind in linears.items()
             if kind in PACKED_TYPES and (kind != main or name == OUTPUT)}
    return WeightOnlyConfig(bits=PACKED_TYPES[main], group_size=BLOCK, modules_to_not_convert=floats or None,
                            module_formats=named or None)


def names_gguf(path_or_id: str | Path) -> bool:
    """Whether `path_or_id` names a GGUF file (by its suffix): what `load_model` / `load_tokenizer` route here."""
    return str(path_or_id).endswith(".gguf")


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its magic bytes)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as file:
        return file.read(4) == b"GGUF"


def _reader(path: Path) -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading GGUF files needs the gguf package: pip install 'hf_accel[gguf]'")
    if not is_gguf(path):
        raise ValueError(f"path {str(path)!r} is not a GGUF file (no such file, or no GGUF magic)")
    import gguf

    return gguf.GGUFReader(path)


def _tensor_names(skeleton: PreTrainedModel, architecture: str, tensors: dict[str, Any]) -> dict[str, str]:
    """The model's state-dict keys -> the GGUF tensor names holding them (a tied output layer has none)."""
    import gguf

    config = skeleton.config
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    names, missing = {}, []
    for key in skeleton.state_dict():
        if config.tie_word_embeddings and key == f"{OUTPUT}.weight":
            continue
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None or name not in tensors:
            missing.append(f"{key} ({name or 'no GGUF name'})")
        else:
            names[key] = name
    if missing:
        raise ValueError(f"GGUF file lacks tensors the {architecture} model needs: {', '.join(missing[:8])}")
    unused = sorted(set(tensors) - set(names.values()) - {"rope_freqs.weight"})
    if unused:
        raise ValueError(f"GGUF tensors the {architecture} model has no place for: {', '.join(unused[:8])}")
    return names


def _linear_kinds(skeleton: PreTrainedModel, names: dict[str, str], tensors: dict[str, Any]) -> dict[str, str]:
    """Linear module name -> the GGUF type of its weight ("F32", "Q8_0", ...); a Q8_0 / Q4_0 weight that cannot be
    kept packed (in_features not whole blocks) counts as float."""
    kinds = {}
    for module_name, module in skeleton.named_modules():
        if isinstance(module, nn.Linear) and module_name + ".weight" in names:
            kind = tensors[names[module_name + ".weight"]].tensor_type.name
            kinds[module_name] = kind if kind not in PACKED_TYPES or module.in_features % BLOCK == 0 else "F32"
    return kinds


def _main_kind(linears: dict[str, str]) -> str | None:
    """The packed type most decoder Linears have (the output layer votes only where no decoder Linear is packed)."""
    packed = {name: kind for name, kind in linears.items() if kind in PACKED_TYPES}
    votes = collections.Counter(kind for name, kind in packed.items() if name != OUTPUT) or collections.Counter(
        packed.values())
    return votes.most_common(1)[0][0] if votes else None


def _row_order(key: str, config: Any, architecture: str) -> torch.Tensor | None:
    """The rows of GGUF tensor `key` in transformers' order, where the converter interleaved them (llama's q / k
    projections: per head, rows (pair, half) became (half, pair)); None to keep them."""
    if architecture not in ROTARY_INTERLEAVED or not key.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    heads = config.num_attention_heads if key.endswith("q_proj.weight") else config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = torch.arange(heads * head_dim).view(heads, head_dim // 2, 2)  # GGUF row of (head, half, pair)
    return rows.transpose(1, 2).reshape(-1)  # transformers' row (head, pair, half) comes from this GGUF row


def _shape(tensor: Any) -> tuple[int, ...]:
    """The tensor's shape in torch order (GGUF lists the fastest-moving dimension first)."""
    return tuple(int(size) for size in reversed(tensor.shape.tolist()))


def _dequantized(tensor: Any, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    from gguf import quants

    values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(_shape(tensor))  # a copy: the file is read-only
    return (out if rows is None else out[rows]).to(dtype)


def _blocks(tensor: Any, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 / Q4_0 tensor -> (codes `[out, in]`: int8 for Q8_0, uint8 0..15 for Q4_0; fp16 `d` `[out, in / 32]`)."""
    out_features, in_features = _shape(tensor)
    raw = torch.from_numpy(np.array(tensor.data))  # a copy: the file is read-only
    raw = raw.view(out_features, in_features // BLOCK, -1)  # [out, blocks, 2 + block bytes]
    d = raw[..., :2].contiguous().view(torch.float16).squeeze(-1)  # [out, blocks]
    packed = raw[..., 2:]
    if tensor.tensor_type.name == "Q8_0":
        codes = packed.contiguous().view(torch.int8).reshape(out_features, in_features)
    else:  # byte j: input j (low nibble), input j + 16 (high)
        codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(out_features, in_features)
    if rows is not None:
        codes, d = codes[rows], d[rows]
    return codes.contiguous(), d.contiguous()


def _packed_state(module_name: str, tensor: Any, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The checkpoint-format parameters (`hf_accel.quant.weights`) of the Linear holding GGUF `tensor`."""
    codes, d = _blocks(tensor, rows)
    if tensor.tensor_type.name == "Q8_0":
        return {f"{module_name}.weight": weights.pack_words(codes, 8), f"{module_name}.weight_scale": d.float()}
    qparams = torch.stack([d.float(), torch.zeros_like(d, dtype=torch.float32)], dim=-1)  # [out, G, 2]
    return {f"{module_name}.weight": weights.pack_words(codes, 4),
            f"{module_name}.weight_qparams": qparams.transpose(0, 1).contiguous()}  # [G, out, 2]
