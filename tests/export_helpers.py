"""What the export tests share: a tiny model folder to export, and `serve.sh` run with a stand-in `vllm`."""

import os
import subprocess
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_accel import reference


def tiny_folder(path: Path, intermediate_size: int = 128) -> Path:
    """A tiny random Llama (fp32, in_features 64 and `intermediate_size`) saved with the reference tokenizer."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(reference.ASSETS_DIR / "tokenizer")
    config = LlamaConfig(hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=256, eos_token_id=None, pad_token_id=0, initializer_range=0.05)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_serve_sh(out: Path, tmp_path: Path) -> list[str]:
    """Check `serve.sh` parses (`bash -n`), then run it with a stand-in `vllm` on PATH that prints its arguments one
    a line; the arguments `vllm` would get."""
    script = out / "serve.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "vllm").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(script), "--port", "8001"], env=env, capture_output=True, text=True,
                            check=True)
    return result.stdout.splitlines()
