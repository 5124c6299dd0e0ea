"""Shared test fixtures: one torch thread everywhere, dynamo's caches emptied at each test file's start, eager engine
steps unless a test is marked `compiled`, loading a benchmark script as a module, and the reference target with its
committed Medusa heads."""

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models run fastest on one thread, and stay deterministic whatever else shares the machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True, scope="module")
def fresh_dynamo():
    """Each test file starts with dynamo's caches empty, as in a process of its own. Rule: a code object every model
    shares (transformers' forward wrapper) collects a cache entry per compiled model, and across the files one worker
    runs they reached dynamo's recompile limit in whichever file came later (a fullgraph compile then fails)."""
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def eager_engines(request, monkeypatch):
    """Engines built in tests run their model step eagerly (compiling every tiny model would cost seconds per test),
    unless the test is marked `compiled`, which gets the default, compiled step (tests/test_engine_compiled.py)."""
    if request.node.get_closest_marker("compiled") is None:
        from hf_accel import EngineConfig

        monkeypatch.setitem(EngineConfig.__init__.__kwdefaults__, "enforce_eager", True)


@pytest.fixture
def load_benchmark(monkeypatch) -> Callable[[str], ModuleType]:
    """`load_benchmark("bench_paged")`: benchmarks/bench_paged.py imported as a module (registered in sys.modules for
    the test, as dataclasses look their module up while being defined)."""
    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def reference_with_heads():
    """`(target, tokenizer, heads)`: the reference target in fp32 and its committed Medusa heads (skips the test when
    the assets are not built)."""
    from hf_accel import MedusaHeads, reference
    from hf_accel.training.medusa_command import REFERENCE_HEADS_DIR

    if not (reference.has_assets() and (REFERENCE_HEADS_DIR / "medusa_config.json").is_file()):
        pytest.skip("reference assets not built")
    target, tokenizer = reference.load("target")
    return target, tokenizer, MedusaHeads.from_pretrained(REFERENCE_HEADS_DIR, dtype=torch.float32)
