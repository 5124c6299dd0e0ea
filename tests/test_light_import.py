"""`import hf_accel` loads what registration needs and nothing else; every public name still resolves."""

import ast
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_accel

# packages `import hf_accel` must not load: they load on first use of a public name from them
DEFERRED = ("hf_accel.engine", "hf_accel.server", "hf_accel.training", "hf_accel.speculative", "hf_accel.bench",
            "hf_accel.export", "hf_accel.reference", "hf_accel.compiled.decode_loop",
            "hf_accel.compiled.speculative_entry", "hf_accel.structured.grammars", "hf_accel.structured.logits",
            "hf_accel.structured.matcher", "xgrammar")  # structured outputs: loaded by the first constrained call


def _modules_after(code: str) -> list[str]:
    """hf_accel's modules (and xgrammar's) loaded in a fresh interpreter after running `code`."""
    probe = (f"import sys, json\n{code}\nprint(json.dumps(sorted(m for m in sys.modules "
             "if m.startswith(('hf_accel', 'xgrammar')))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_loads_registration_only_and_registers():
    loaded = _modules_after("import hf_accel\nfrom transformers.generation import configuration_utils as c\n"
                            "assert 'hf_accel_paged' in c.ALL_CACHE_IMPLEMENTATIONS, 'not registered'")
    assert "hf_accel.registry" in loaded and "hf_accel.cache.paged" in loaded
    assert not [m for m in loaded if m.startswith(DEFERRED)], "import hf_accel loaded deferred modules"


def test_a_public_name_loads_its_module_on_first_use():
    loaded = _modules_after("import hf_accel\nhf_accel.Engine")
    assert "hf_accel.engine.engine" in loaded
    assert not [m for m in loaded if m.startswith(("hf_accel.server", "hf_accel.training"))]


@pytest.mark.parametrize("name", hf_accel.__all__)
def test_every_public_name_resolves_and_is_listed(name):
    assert getattr(hf_accel, name) is not None
    assert name in dir(hf_accel)


def test_unknown_and_deprecated_names():
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        hf_accel.Nonexistent  # noqa: B018
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hf_accel.MedusaStats is hf_accel.SpeculativeStats
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def test_the_type_checking_imports_name_the_lazy_names():
    """Type checkers and the API docs read the `if TYPE_CHECKING:` imports; `__getattr__` reads `_LAZY`."""
    tree = ast.parse(Path(hf_accel.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    imported = {alias.name: node.module for node in block.body for alias in node.names}
    assert imported == hf_accel._LAZY
