"""Shared test fixtures: one torch thread everywhere, and loading a benchmark script as a module."""

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
