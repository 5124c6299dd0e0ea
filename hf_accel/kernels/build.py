"""Building hf_accel's C++ extension: every source of `csrc/` compiled into one library with torch's `cpp_extension`
at first use, registering its ops under `torch.ops.hf_accel` (`custom_ops.py` names them and gives each a fake).

Building needs a C++ compiler, the Python headers and `ninja` (all on the machines this project runs on); the first
build takes about half a minute on two cores (each source includes ATen and the op registry only, not
`torch/extension.h`, whose Python and nn headers tripled the compile) and is cached (`build_directory()`, under
`~/.cache/torch_extensions` or `$TORCH_EXTENSIONS_DIR`). Processes build one at a time under an OS file lock, which
dies with its process: torch's own lock file, left behind by a process killed mid-build, would otherwise make every
later process wait for it forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
PAGED_ATTENTION_SOURCE = CSRC / "paged_attention.cpp"  # paged_attention, paged_tree_attention
QUANTIZED_ATTENTION_SOURCE = CSRC / "quantized_attention.cpp"  # quantized_decode_attention
PACKED_LINEAR_SOURCE = CSRC / "packed_linear.cpp"  # packed_linear
QUANTIZED_LINEAR_SOURCE = CSRC / "quantized_linear.cpp"  # int8_linear, int4_linear
TOKEN_BITMASK_SOURCE = CSRC / "token_bitmask.cpp"  # apply_token_bitmask
LORA_SOURCE = CSRC / "lora.cpp"  # lora_add
HUGE_PAGES_SOURCE = CSRC / "huge_pages.cpp"  # huge_page_copy
SOURCES = (PAGED_ATTENTION_SOURCE, QUANTIZED_ATTENTION_SOURCE, PACKED_LINEAR_SOURCE, QUANTIZED_LINEAR_SOURCE,
           TOKEN_BITMASK_SOURCE, LORA_SOURCE, HUGE_PAGES_SOURCE)
# `omp simd` loops vectorized; their reductions may reassociate, so results match the gather path up to float
# rounding, not bit for bit
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
          "-fopenmp"]  # ATen's `parallel_for` is OpenMP inlined into the caller: without it the kernels run serially
LDFLAGS = ["-fopenmp"]  # libgomp: the copy torch ships and has loaded already (same soname)


def build_extension() -> None:
    """Build (or load from the cache) the extension into this process; raises what the build raises."""
    from torch.utils.cpp_extension import load

    build = build_directory()
    build.mkdir(parents=True, exist_ok=True)
    with _exclusive(build.parent / f"{build.name}.lock"):
        # inside the lock no other process is building here: torch's lock file, if any, is a dead process's
        (build / "lock").unlink(missing_ok=True)
        load(name=build.name, sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
             build_directory=str(build), is_python_module=False, verbose=False)


def is_built() -> bool:
    """Whether the extension's library is in the build cache (a first use then loads it instead of building)."""
    build = build_directory()
    return (build / f"{build.name}.so").is_file()


def build_directory() -> Path:
    """Where the extension is built and cached. -march=native: built where it runs (torch's own kernels dispatch at
    run time instead), so the name carries the CPU's feature flags (a cache shared between different CPUs never hands
    one the other's binary), the sources' hash (two versions of hf_accel never rebuild over each other), and the
    folder the Python and torch versions the binary was built against."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # torch's own rule for its builds
    versions = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(root) / versions / f"hf_accel_paged_attention_{_cpu_tag()}_{_source_tag()}"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive OS lock on `path` (released by the OS if this process dies); no lock where `fcntl` is
    missing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags (empty where /proc/cpuinfo is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    lines = sorted({line for line in text.splitlines() if line.startswith(("flags", "model name", "Features"))})
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def _source_tag() -> str:
    """A short hash of every file of `csrc/`: the sources and the headers they include."""
    files = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    return hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()[:12]
