"""The engine's in-place paged attention: `csrc/paged_attention.cpp`, a C++ kernel built with torch's `cpp_extension` at
first use and registered as the custom op `torch.ops.hf_accel.paged_attention` (it mutates the two pools it writes,
and has a fake implementation, so a compiled model step traces around it as one opaque node). The same extension
holds `torch.ops.hf_accel.paged_tree_attention` (the same rule with a speculative tree's mask:
`paged_tree_attention_kernel()`), `torch.ops.hf_accel.quantized_decode_attention` (`csrc/quantized_attention.cpp`:
compiled generate's quantized cache, attention over packed codes; `quantized_attention_kernel()`) and
`torch.ops.hf_accel.packed_linear` (`csrc/packed_linear.cpp`: the compiled steps' Linears of a few rows;
`packed_linear_kernel()`).

For one layer of one step it writes the step's new K/V into their slots, then every sequence's queries (decodes,
speculative candidates, prefill chunks) attend over that sequence's blocks where they lie (block table, lengths), so
a step copies no context; see the .cpp file for the shapes and the masking rule. Building needs a C++ compiler, the
Python headers and `ninja` (all on the machines this project runs on); the first build takes about half a minute and
is cached (`build_directory()`, under `~/.cache/torch_extensions` or `$TORCH_EXTENSIONS_DIR`). Processes build one at a
time under an OS file lock, which dies with its process: torch's own lock file, left behind by a process killed
mid-build, would otherwise make every later process wait for it forever. Where it cannot be built, or with
`HF_ACCEL_PAGED_KERNEL=0`, `paged_attention_kernel()` returns None and the engine runs `attention.gathered_attention`
instead (the same rule over blocks copied out of the pool, sdpa on them: the same results up to float rounding).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
# built into the same extension: compiled generate's quantized-cache decode attention (`quantized_attention_kernel`)
QUANTIZED_SOURCE = SOURCE.with_name("quantized_attention.cpp")
# and the compiled steps' Linears over packed weights (`packed_linear_kernel`, `packed_linears.py`)
LINEAR_SOURCE = SOURCE.with_name("packed_linear.cpp")
SOURCES = (SOURCE, QUANTIZED_SOURCE, LINEAR_SOURCE)
SWITCH = "HF_ACCEL_PAGED_KERNEL"
# `omp simd` loops vectorized; their reductions may reassociate, so results match the gather path up to float
# rounding, not bit for bit
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"]


_BUILD_LOCK = threading.Lock()  # one build and one fake registration, whichever thread asks first


def paged_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.paged_attention`, built on first call; None when switched off or not buildable."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    with _BUILD_LOCK:
        return _built_kernel()


@functools.cache
def _built_kernel() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.utils.cpp_extension import load

        build = build_directory()
        build.mkdir(parents=True, exist_ok=True)
        with _exclusive(build.parent / f"{build.name}.lock"):
            # inside the lock no other process is building here: torch's lock file, if any, is a dead process's
            (build / "lock").unlink(missing_ok=True)
            load(name=build.name, sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS,
                 build_directory=str(build),
                 is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, headers or ninja: the gather path still works
        warnings.warn(f"hf_accel: the paged attention kernel could not be built ({type(error).__name__}: {error}); "
                      "the engine gathers K/V blocks instead", RuntimeWarning, stacklevel=2)
        return None
    torch.library.register_fake("hf_accel::paged_attention")(_fake)
    torch.library.register_fake("hf_accel::paged_tree_attention")(_fake)
    torch.library.register_fake("hf_accel::quantized_decode_attention")(_quantized_fake)
    torch.library.register_fake("hf_accel::packed_linear")(_linear_fake)
    return torch.ops.hf_accel.paged_attention


def paged_tree_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.paged_tree_attention` (a speculative tree's verify: the paged kernel's rule with a
    `[seqs, n, m]` tree mask as a last argument; see the .cpp file), built with the paged kernel; None where that is
    switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.paged_tree_attention


def quantized_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.quantized_decode_attention` (csrc/quantized_attention.cpp, built with the paged kernel);
    None where that is switched off or not buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.quantized_decode_attention


def packed_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_accel.packed_linear` (csrc/packed_linear.cpp: a Linear of a few rows over a weight packed in
    column panels, `packed_linears.py`), built with the paged kernel; None where that is switched off or not
    buildable."""
    return None if paged_attention_kernel() is None else torch.ops.hf_accel.packed_linear


def build_directory() -> Path:
    """Where the kernel is built and cached. -march=native: built where it runs (torch's own kernels dispatch at run
    time instead), so the name carries the CPU's feature flags (a cache shared between different CPUs never hands one
    the other's binary), the source's hash (two versions of hf_accel never rebuild over each other), and the folder
    the Python and torch versions the binary was built against."""
    from torch.utils.cpp_extension import get_default_build_root

    versions = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(get_default_build_root()) / versions / f"hf_accel_paged_attention_{_cpu_tag()}_{_source_tag()}"


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
    return hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()[:12]


def _fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
          value_pool: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
          kv_lengths: torch.Tensor, scale: float, window: int, softcap: float,
          tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    heads, tokens, dim = query.shape  # -> [tokens, heads, dim]
    return query.new_empty(tokens, heads, dim)


def _quantized_fake(query: torch.Tensor, *args) -> torch.Tensor:
    return query.new_empty(query.shape)  # [rows, heads, dim]


def _linear_fake(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])  # [M, N]
