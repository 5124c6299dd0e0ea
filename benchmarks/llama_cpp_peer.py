"""llama.cpp beside hf_accel, for benchmarks: find (or build) its tools, convert a transformers checkpoint folder to
GGUF with llama.cpp's own converter, quantize it with `llama-quantize`, and time decode with `llama-bench`.

Where llama.cpp comes from: the source vendored in `llama-cpp-python`'s sdist (the registry has it; no hub, no git),
built with cmake into `~/.cache/hf_accel/llama.cpp` (`build()`; a few minutes on two cores), or an existing build
named by `$HF_ACCEL_LLAMA_CPP` (a folder holding `bin/llama-bench`, `bin/llama-quantize` and the source tree's
`convert_hf_to_gguf.py` one level up or in `src/`). Nothing here runs in CI; a benchmark that finds no llama.cpp
skips its rows with a message.

The converter identifies a BPE tokenizer's pre-tokenizer by hashing its output on a test string and refuses one it
does not know, as the reference tokenizer is; for a speed run the pre-tokenizer is declared GPT-2's (it only decides
how text is split into tokens, which `llama-bench` never does: it times random token ids). It also imports
`sentencepiece` before looking for a `tokenizer.model`; a folder without one goes on to its BPE path without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
HOME = Path(os.environ.get("HF_ACCEL_LLAMA_CPP", Path.home() / ".cache/hf_accel/llama.cpp"))
GGUF_TYPES = {"fp32": ("f32", None), "bf16": ("bf16", None), "int8": ("f32", "Q8_0"), "int4": ("f32", "Q4_0")}
CONVERT_PATCH = """
import sys
sys.path[:0] = [{gguf_py!r}, {source!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # speed runs only: see llama_cpp_peer.py
sentencepiece = base.TextModel._set_vocab_sentencepiece
def sentencepiece_where_present(self):  # a tokenizer.json folder needs no sentencepiece package
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece(self)
base.TextModel._set_vocab_sentencepiece = sentencepiece_where_present
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
convert_hf_to_gguf.main()
"""


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """A llama.cpp build: its tools and the source tree holding the converter."""

    bench: Path
    quantize: Path
    source: Path
    version: str

    def convert(self, folder: Path, out: Path, outtype: str) -> Path:
        """The transformers checkpoint `folder` as a GGUF file of `outtype` ("f32", "bf16")."""
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"model-{outtype}.gguf"
        script = CONVERT_PATCH.format(gguf_py=str(self.source / "gguf-py"), source=str(self.source),
                                      args=[str(folder), "--outfile", str(target), "--outtype", outtype])
        _run([sys.executable, "-c", script])
        return target

    def quantized(self, source: Path, kind: str) -> Path:
        """`source` quantized to `kind` ("Q8_0", "Q4_0") by `llama-quantize`, beside it."""
        target = source.with_name(f"model-{kind}.gguf")
        if not target.exists():
            _run([str(self.quantize), str(source), str(target), kind])
        return target

    def greedy_text(self, model: Path, prompt: str, new_tokens: int) -> str:
        """The text `llama-simple` (greedy sampling) writes after `prompt`: `new_tokens` tokens or until end of text."""
        simple = self.bench.with_name("llama-simple")
        out = _run([str(simple), "-m", str(model), "-n", str(new_tokens), prompt], errors="replace")
        if not out.startswith(prompt):
            raise RuntimeError(f"llama-simple did not echo the prompt: {out[:200]!r}")
        return out[len(prompt):].rstrip("\n")

    def decode_tokens_per_second(self, model: Path, threads: int, new_tokens: int, repeats: int) -> float:
        """`llama-bench`'s decode speed (tokens/s, mean of `repeats`), batch 1, no prompt: `-p 0 -n new_tokens`."""
        out = _run([str(self.bench), "-m", str(model), "-p", "0", "-n", str(new_tokens), "-r", str(repeats),
                    "-t", str(threads), "-o", "json"])
        runs = json.loads(out)
        return float(runs[0]["avg_ts"])


def find() -> LlamaCpp | None:
    """The build under `HOME`, if its tools are there."""
    bench, quantize = HOME / "build/bin/llama-bench", HOME / "build/bin/llama-quantize"
    sources = sorted(HOME.glob("src/*/vendor/llama.cpp"))
    if not (bench.is_file() and quantize.is_file() and sources):
        return None
    return LlamaCpp(bench, quantize, sources[-1], sources[-1].parents[1].name)


def build() -> LlamaCpp:
    """Download `SDIST`, build llama-bench, llama-quantize and llama-simple under `HOME` (cmake, a C++ compiler),
    return them."""
    if (found := find()) is not None:
        return found
    (HOME / "sdist").mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST, "-d",
          str(HOME / "sdist")])
    archive = next((HOME / "sdist").glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(HOME / "src", filter="data")
    source = next((HOME / "src").glob("*/vendor/llama.cpp"))
    build_dir = HOME / "build"
    _run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"])
    _run(["cmake", "--build", str(build_dir), "--target", "llama-bench", "llama-quantize", "llama-simple", "-j",
          str(os.cpu_count() or 2)])
    found = find()
    if found is None:
        raise RuntimeError(f"llama.cpp built under {HOME} but its tools are missing")
    return found


def _run(command: list[str], errors: str = "strict") -> str:
    """Run `command`; its stdout, or a RuntimeError with the end of its output. `errors`: how bytes that are not
    UTF-8 decode (llama-simple prints token by token, so a character cut at the last token is half there)."""
    if shutil.which(command[0]) is None and not Path(command[0]).is_file():
        raise RuntimeError(f"{command[0]} not found")
    done = subprocess.run(command, capture_output=True, text=True, errors=errors)
    if done.returncode:
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout
