"""An engine's compiled step functions kept on disk whole (torch's AOT compile), so a new process loads them instead of
tracing them again.

Steps whose graphs hold no weight (fp32 Linears over kept panels: `kernels/linear_panels.py`) are compiled with
`torch.compile(...).aot_compile` on the first call's inputs and saved with `save_compiled_function`, beside
inductor's own caches (`$TORCHINDUCTOR_CACHE_DIR/hf_accel_steps`; `HF_ACCEL_SAVED_STEPS=0` turns this off). A new
process on a model of the same shape loads the saved function (`torch.compiler.load_compiled_function`): no dynamo
tracing, no guard building, no AOT autograd or inductor work, only the load of the compiled code (vLLM keeps its
graphs on disk the same way).

A saved function runs without guards, as vLLM's do: which function runs which step is the caller's choice, and
everything a guard would have checked is in the file's key instead (`step_key`): the model's class, config, dtype,
module tree and tensors' shapes (`model_description`), the code of its modeling modules as it is now (a function
patched at run time counts), which Linears run over panels and where in the buffer, the step's example inputs
(every tensor's shape, stride and dtype, the KV pool's among them: the graphs fix its size), the attention function,
and the versions of torch, transformers, Python and hf_accel's own source, with the CPU's instruction set. Any change
gives another file. A model with forward hooks is saved only where every hook states what its compiled code depends
on (`hook_descriptions`: LoRA's hooks, whose tensors are the step's inputs); any other hook (captured hidden states, a
user's) keeps the step in this process (`persist=False`: compiled the same way, run without guards, never written).
A file that fails to load is removed with a warning and the step compiled again, never run; one that fails to save
is used in this process only, with a warning.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import hashlib
import importlib
import inspect
import json
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch._dynamo.utils import counters

ENV_SWITCH = "HF_ACCEL_SAVED_STEPS"  # "0": engines compile their steps in every process, as before
FOLDER = "hf_accel_steps"  # under inductor's cache folder
_MODULE_PREFIX = "___module_"  # dynamo's global name for a module the compiled code loads (`import_sources` aside)


def enabled() -> bool:
    """Whether engines keep their compiled steps on disk (`HF_ACCEL_SAVED_STEPS` not "0")."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def folder() -> Path:
    """Where saved steps lie: in inductor's cache folder, so clearing that (or pointing it elsewhere) clears them."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / FOLDER


class SavedStep:
    """`function(model, **kwargs)` compiled whole on its first call's inputs and kept on disk (`persist`; else in
    this process only); later calls (inputs of the same layout, sizes that the graph left dynamic aside) run it
    without guards. `dynamic` as `torch.compile`'s; `describe_model` gives what of the model the compiled code depends
    on (`model_description`)."""

    def __init__(self, function: Callable, dynamic: bool, name: str, describe_model: Callable[[nn.Module], Any],
                 persist: bool = True):
        self.function, self.dynamic, self.name, self.describe_model = function, dynamic, name, describe_model
        self.persist = persist
        self.compiled: Callable | None = None

    def __call__(self, model: nn.Module, **kwargs: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._load_or_compile(model, kwargs)
        return self.compiled(model, **kwargs)

    def _load_or_compile(self, model: nn.Module, kwargs: dict[str, Any]) -> Callable:
        if not self.persist:
            compiled = self._compile(model, kwargs)
            compiled.disable_guard_check()  # the caller keys it as a saved step's file is keyed
            return compiled
        key = step_key(self.name, self.dynamic, self.describe_model(model), kwargs)
        path = folder() / f"{key}.bin"
        compiled = _load(path, self.function.__globals__)
        if compiled is not None:
            counters["hf_accel"]["saved_steps_loaded"] += 1  # beside dynamo's count of the graphs it traces
        else:
            compiled = self._compile(model, kwargs)
            _save(compiled, path, self.function.__globals__)
        compiled.disable_guard_check()  # the key stands for the guards (see the module docstring)
        return compiled

    def _compile(self, model: nn.Module, kwargs: dict[str, Any]):
        compiled = torch.compile(self.function, dynamic=self.dynamic, fullgraph=True,
                                 options={"guard_filter_fn": _no_guards})
        return compiled.aot_compile(((model,), kwargs))


def step_key(name: str, dynamic: bool, model: Any, kwargs: dict[str, Any]) -> str:
    """The file name of a step: a hash of everything its compiled code depends on (see the module docstring)."""
    described = {
        "step": name, "dynamic": dynamic, "model": model, "inputs": describe(kwargs),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version,
        "cpu": (platform.machine(), torch.backends.cpu.get_cpu_capability()), "hf_accel": _source_hash(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def hook_descriptions(model: nn.Module) -> list | None:
    """The forward hooks of `model`'s modules by module name and their descriptions, or None where one has none or
    torch's global module hooks hold any (then its steps are not saved). A hook describes itself by its attribute
    `step_description` (JSON-able): all its compiled code depends on beyond hf_accel's source and the step's inputs,
    i.e. its constants; every tensor it reads must be a step input (LoRA's hooks: `lora/layers.py`)."""
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_pre_hooks or module_globals._global_forward_hooks:
        return None
    described = []
    for name, module in model.named_modules():
        for kind, hooks in (("pre", module._forward_pre_hooks), ("post", module._forward_hooks)):
            for hook in hooks.values():
                description = getattr(hook, "step_description", None)
                if description is None:
                    return None
                described.append([name, kind, description])
    return described


def model_description(model: nn.Module, panels: list[tuple[str, int]]) -> dict[str, Any]:
    """What of `model` a step's compiled code depends on: its class, config (its path aside) and mode, the code of
    its modules' files as it is now, its module tree, its tensors' names, shapes and dtypes, the Linears run over
    panels with their offsets (`panels`), and its described hooks (`hook_descriptions`)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    tensors = [(name, tuple(t.shape), str(t.dtype)) for name, t in (*model.named_parameters(),
                                                                     *model.named_buffers())]
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}", "config": config,
            "training": model.training, "code": _code_hash({type(module) for module in model.modules()}),
            "modules": [(name, type(m).__qualname__) for name, m in model.named_modules()],
            "tensors": tensors, "panels": panels, "hooks": hook_descriptions(model)}


def describe(value: Any, depth: int = 0) -> Any:
    """A step input as far as compiled code depends on it: tensors by shape, stride, dtype and device; objects by
    type and fields; functions by name."""
    if depth > 6:
        return type(value).__qualname__
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype), str(value.device)]
    if isinstance(value, (list, tuple)):
        return [describe(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {str(k): describe(v, depth + 1) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value) and not dataclasses.is_dataclass(value):
        return ["callable", getattr(value, "__qualname__", None) or getattr(value, "__name__", repr(type(value)))]
    fields = vars(value) if hasattr(value, "__dict__") else {
        f.name: getattr(value, f.name) for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else {}
    return [type(value).__qualname__, {k: describe(v, depth + 1) for k, v in fields.items()}]


def _code_hash(classes: set[type]) -> str:
    """A hash of the code the classes' modules hold now (their functions and the methods of their classes): a
    modeling file edited, or a function or forward replaced at run time (a kernel library patching it), gives new
    keys."""
    digest = hashlib.sha256()
    for module in sorted({sys.modules[cls.__module__] for cls in classes}, key=lambda module: module.__name__):
        for name, value in sorted(vars(module).items()):
            functions = vars(value).values() if isinstance(value, type) else (value,)
            for function in functions:
                code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
                if code is not None:
                    digest.update(f"{module.__name__}.{name}:".encode() + _code_bytes(code))
    return digest.hexdigest()


def _code_bytes(code) -> bytes:
    """`code`'s bytecode, names and constants (nested code objects likewise), the same in every process (no
    addresses, sets sorted)."""
    parts = [code.co_code, repr(code.co_names).encode()]
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            parts.append(_code_bytes(const))
        else:
            parts.append(repr(sorted(map(repr, const)) if isinstance(const, frozenset) else const).encode())
    return b"".join(parts)


def _no_guards(entries: list) -> list[bool]:
    """`torch.compile`'s `guard_filter_fn` keeping none: the key stands for them."""
    return [False] * len(entries)


@functools.cache
def _source_hash() -> str:
    """A hash of hf_accel's Python sources and C++ kernels: any edit gives new keys."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((*root.rglob("*.py"), *root.rglob("*.cpp"))):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _load(path: Path, function_globals: dict[str, Any]):
    """The step saved at `path`, or None where there is none or it fails to load (then removed, with a warning)."""
    modules_path = path.with_suffix(".json")
    if not path.exists() or not modules_path.exists():
        return None
    try:
        modules = json.loads(modules_path.read_text())
        f_globals = {**function_globals, **{name: importlib.import_module(module) for name, module in modules.items()}}
        with open(path, "rb") as file:
            return torch.compiler.load_compiled_function(file, f_globals=f_globals)
    except Exception as error:  # a corrupt or stale file: compile again, never run it
        warnings.warn(f"hf_accel: the saved engine step {path} could not be loaded ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); compiling it again", RuntimeWarning,
                      stacklevel=4)
        for stale in (path, modules_path):
            stale.unlink(missing_ok=True)
        return None


def _save(compiled, path: Path, function_globals: dict[str, Any]) -> None:
    """Write `compiled` to `path` (atomically), with the modules its code loads by dynamo's names beside it
    (`.json`, written last: a step is saved once both are there)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        compiled.save_compiled_function(str(path))
        modules = {name: function_globals[name].__name__ for name in _loaded_modules(compiled.fn.__code__)
                   if name in function_globals}
        temporary = path.with_suffix(f".json.{os.getpid()}")
        temporary.write_text(json.dumps(modules))
        os.replace(temporary, path.with_suffix(".json"))
    except Exception as error:  # e.g. a read-only cache folder: this process still runs the compiled step
        warnings.warn(f"hf_accel: the compiled engine step could not be saved to {path} ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); the next process compiles it again",
                      RuntimeWarning, stacklevel=4)


def _loaded_modules(code) -> set[str]:
    """The global names under which `code` (and the code objects inside it) loads modules dynamo installed."""
    names = {ins.argval for ins in dis.get_instructions(code)
             if ins.opname == "LOAD_GLOBAL" and str(ins.argval).startswith(_MODULE_PREFIX)}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _loaded_modules(const)
    return names
