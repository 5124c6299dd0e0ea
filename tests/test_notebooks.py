"""Every notebook in notebooks/ runs top to bottom in a real IPython kernel (nbclient) within its time limit, ends with
a plot or a rich table, saves figures only when asked, and is stored in git without outputs.

The kernel is this interpreter (`sys.executable -m ipykernel_launcher`, from a kernelspec written to a temporary
folder), so it imports the hf_accel this test suite imports and needs no user-level kernelspec. A notebook states its
parameters in a cell tagged `parameters`; the runner may add a cell right after it that overrides some of them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
KERNEL_NAME = "hf_accel-tests"
TOTAL_LIMIT_S = 840 + 480  # all notebooks together, on the shared 2-core CI CPU; + finetune_then_serve's limit


@dataclass(frozen=True)
class NotebookRun:
    """How CI runs one notebook: its wall-clock limit, code run in its kernel afterwards (asserts on its variables),
    and whether it is asked to save its figures (to a temporary folder, `SAVE_PLOTS_TO`)."""

    limit_s: int
    check: str
    save_plots: bool = False
    parameters: dict[str, object] = field(default_factory=dict)


# one entry per notebook in notebooks/
NOTEBOOKS = {
    "quickstart.ipynb": NotebookRun(90, "assert set(runs) >= {'DynamicCache', 'paged', 'draft', 'medusa'}"),
    "kv_caches.ipynb": NotebookRun(
        150, "assert isinstance(streams['sink'], hf_accel.SinkCache) and len(memory['DynamicCache']) > 1",
        save_plots=True),
    "speculative.ipynb": NotebookRun(120, "assert trained.last_step == TRAIN_STEPS and medusa_stats.num_target_forwards"),
    "weight_quantization.ipynb": NotebookRun(90, "assert {'fp32', 'int8', 'int4'} <= set(measured)"),
    "paged_cache.ipynb": NotebookRun(60, "assert isinstance(cache, hf_accel.PagedCache)"),
    "serving.ipynb": NotebookRun(  # its engines compile two graphs each at start; beside another xdist worker
        240, "assert completion.choices[0].text and chat.choices[0].message.content is not None "
            "and sum(ttft_counts) >= NUM_REQUESTS + 2 and not engine.is_running",
        save_plots=True),
    "structured_outputs.ipynb": NotebookRun(
        90, "assert isinstance(book, Book) and set(results) == set(constraints) "
            "and call.function.name == 'get_weather'"),
    "finetune_then_serve.ipynb": NotebookRun(
        480, "assert report['perplexity']['finetuned']['domain'] < report['perplexity']['base']['domain'] "
             "and completion.choices[0].text and stats.spec_decode_num_drafts > 0 and not engine.is_running "
             "and (out / 'medusa' / 'medusa_heads.safetensors').is_file() "
             "and served_models == ['base', 'markdown', 'rst'] and all(answers.values()) "
             "and len(set(answers.values())) > 1 and not lora_engine.is_running "
             "and all(r['perplexity']['finetuned']['domain'] < r['perplexity']['base']['domain'] "
             "for r in adapters.values())"),
}


def kernel_manager(folder: Path) -> KernelManager:
    """A manager for a kernel running this interpreter, from a kernelspec in `folder` (no user-level install)."""
    spec_dir = folder / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hf_accel tests", "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(folder)], ensure_native_kernel=False)
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def with_parameters(notebook: nbformat.NotebookNode, parameters: dict[str, object]) -> nbformat.NotebookNode:
    """`notebook` with a cell setting `parameters` right after its cell tagged `parameters`."""
    index = next((i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])), None)
    assert index is not None, "a notebook states its parameters in a cell tagged 'parameters'"
    if parameters:
        source = "\n".join(f"{name} = {value!r}" for name, value in parameters.items())
        notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    return notebook


def execute(name: str, run: NotebookRun, folder: Path) -> tuple[nbformat.NotebookNode, float]:
    """Run notebook `name` with `run`'s parameters and check in its kernel; returns it with outputs, and seconds."""
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    parameters = dict(run.parameters, **({"SAVE_PLOTS_TO": str(folder / "plots")} if run.save_plots else {}))
    notebook = with_parameters(notebook, parameters)
    notebook.cells.append(nbformat.v4.new_code_cell("import hf_accel\n" + run.check))
    manager = kernel_manager(folder / "kernels")
    client = NotebookClient(notebook, km=manager, timeout=run.limit_s,
                            startup_timeout=120, resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    started = time.perf_counter()
    try:
        client.execute()
    finally:  # nbclient leaves a kernel it was handed running: stop it, or every notebook's kernel lives on
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
    return notebook, time.perf_counter() - started


def rich_outputs(cell: nbformat.NotebookNode) -> set[str]:
    """MIME types of `cell`'s display outputs that are a plot or a rich table."""
    kinds = {"display_data", "execute_result"}
    return {mime for out in cell.outputs if out.output_type in kinds for mime in out.data} & {"image/png", "text/html"}


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_runs_in_a_kernel_within_its_limit(name, tmp_path):
    run = NOTEBOOKS[name]
    notebook, seconds = execute(name, run, tmp_path)
    print(f"{name}: {seconds:.1f} s (limit {run.limit_s} s)")
    assert seconds <= run.limit_s
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert rich_outputs(code[-2]), f"{name} must end with a plot or a rich table"  # [-1] is the check cell
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors
    plots = sorted((tmp_path / "plots").glob("*.png"))
    assert bool(plots) == run.save_plots, "figures are saved exactly when SAVE_PLOTS_TO is set"
    for plot in plots:
        print("saved plot:", plot)


def test_every_notebook_is_run_and_all_fit_the_ci_budget():
    assert {path.name for path in NOTEBOOK_DIR.glob("*.ipynb")} == set(NOTEBOOKS)
    assert sum(run.limit_s for run in NOTEBOOKS.values()) <= TOTAL_LIMIT_S


@pytest.mark.parametrize("path", sorted(NOTEBOOK_DIR.glob("*.ipynb")), ids=lambda path: path.name)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), \
        f"strip outputs and execution counts from {path.name} before committing"
    assert any("parameters" in cell.metadata.get("tags", []) for cell in code)
