"""Same-process interleaved timing: the loop every comparison runs through (`time_interleaved`, also behind
`hf_accel.training.finetune_quality.compare_speed`), its use for generation strategies (`compare_strategies`), and
the thread count.

Rules every measurement here follows (shared by `hf-accel bench` and `benchmarks/`):
- all strategies run in one process on one model, interleaved (the order alternates every repeat), after warm-up;
- decode time = time(generate N new tokens) - time(generate 1 new token), so prefill is excluded; a pair whose
  difference is not above zero (a load spike in the one-token run) is measured again, up to `PAIR_ATTEMPTS` times;
- a strategy's decode time is the median over repeats; its speed ratio to the baseline (the first strategy) is the
  median of per-repeat ratios, each taken within one repeat, so slow drift in machine load cancels out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .results import StrategyResult, summarize
from .strategies import STRATEGIES, Strategy

Key = TypeVar("Key", bound=Hashable)
PAIR_ATTEMPTS = 3  # tries of a (1 token, N tokens) pair before its non-positive difference is kept


@dataclass(slots=True)
class Timings(Generic[Key]):
    """What `time_interleaved` measured: each key's seconds, one per measured round in round order, and the output
    of its last call."""

    seconds: dict[Key, list[float]]
    outputs: dict[Key, Any]


def time_interleaved(
    keys: Sequence[Key], measure: Callable[[Key], tuple[float, Any]], repeats: int, warmup: int = 1
) -> Timings[Key]:
    """`warmup + repeats` rounds of `measure(key)` -> (seconds, output) over every key, in the order of `keys` and
    reversed every other round, so no key always runs first after another; warm-up rounds' seconds are dropped."""
    seconds: dict[Key, list[float]] = {key: [] for key in keys}
    outputs: dict[Key, Any] = {}
    for repeat in range(warmup + repeats):
        for key in keys if repeat % 2 == 0 else list(reversed(keys)):
            elapsed, outputs[key] = measure(key)
            if repeat >= warmup:
                seconds[key].append(elapsed)
    return Timings(seconds, outputs)


def run_generate(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], strategy: Strategy, new_tokens: int, **kwargs: Any
) -> tuple[float, Any]:
    """Seconds taken and the output (with `sequences` and `past_key_values`) for exactly `new_tokens`: the strategy's
    own `run` when it has one, else `generate` with its kwargs."""
    if strategy.run is not None:
        start = time.perf_counter()
        output = strategy.run(model, inputs, new_tokens)
        return time.perf_counter() - start, output
    max_len = inputs["input_ids"].shape[1] + new_tokens
    options = {"do_sample": False, **kwargs, **strategy.generate_kwargs(model, max_len)}
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True, **options
        )
    return time.perf_counter() - start, output


def compare_strategies(
    model: PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    new_tokens: int,
    strategies: Sequence[Strategy] = STRATEGIES,
    repeats: int = 3,
    warmup: int = 1,
    on_step: Callable[[str], None] | None = None,
    progress: bool = True,
    on_error: Callable[[str, Exception], None] | None = None,
) -> list[StrategyResult]:
    """Time decode of every strategy, interleaved, and compare with `strategies[0]`; `on_step` after each run pair,
    a `tqdm.auto` bar over the runs unless `progress=False`. A strategy with a `model_variant` runs on that variant of
    `model`, built once at its first run, untimed. With `on_error`, a strategy other than the baseline whose variant
    or run raises is left out of the results and `on_error(name, error)` told why (without it, the error
    propagates)."""
    if new_tokens < 2:
        raise ValueError(f"`new_tokens` must be at least 2 to measure decode, got {new_tokens}")
    runs = _Runs(model, inputs, new_tokens, strategies, on_step, on_error)
    with tqdm(total=(warmup + repeats) * len(strategies), desc="compare", unit="run", leave=False,
              disable=not progress) as runs.bar:
        timings = time_interleaved([s.name for s in strategies], runs.decode, repeats, warmup)
    kept = [s for s in strategies if s.name not in runs.failed]
    return summarize(kept, {s.name: timings.seconds[s.name] for s in kept},
                     {s.name: timings.outputs[s.name] for s in kept}, inputs, new_tokens)


class _Runs:
    """The runs `compare_strategies` times: each strategy's model (its variant built once, at its first run), the
    progress bar, and the strategies that failed (left out, when `on_error` is given)."""

    def __init__(self, model, inputs, new_tokens, strategies, on_step, on_error):
        self.inputs, self.new_tokens, self.on_step, self.on_error = inputs, new_tokens, on_step, on_error
        self.baseline, self.by_name = strategies[0].name, {s.name: s for s in strategies}
        self.failed: set[str] = set()
        self.warmed: set[str] = set()
        self.bar = None
        self.model = model
        self.variants: dict[str, PreTrainedModel] = {}  # built at a strategy's first run: by then hf_accel's kernels
        # have built in the background (a quantized variant re-lays its weights for them, which waits for the build)

    def decode(self, name: str) -> tuple[float, Any]:
        """Seconds of `name`'s decode (time(new_tokens) - time(1 token): prefill excluded) and its output; (0, None)
        once it has failed."""
        result = self._attempt(name, lambda: self._timed(name)) if name not in self.failed else None
        if result is None:
            self.bar.update()
            return 0.0, None
        return result

    def _timed(self, name: str) -> tuple[float, Any]:
        # a strategy's first run may build hf_accel's C++ kernels or compile its steps: say so while it waits
        first_run = self.by_name[name].first_run or ("first run (builds kernels / compiles where it needs them; "
                                                     "minutes on a cold cache, seconds once cached)")
        self.bar.set_postfix_str(name if name in self.warmed else f"{name}: {first_run}")
        self.warmed.add(name)
        strategy = self.by_name[name]
        model = self.model if strategy.model_variant is None else self._variant(strategy)
        for _ in range(PAIR_ATTEMPTS):
            prefill_time, _ = run_generate(model, self.inputs, strategy, 1)
            total_time, output = run_generate(model, self.inputs, strategy, self.new_tokens)
            if total_time > prefill_time:
                break
        self.bar.update()
        if self.on_step is not None:
            self.on_step(name)
        return total_time - prefill_time, output

    def _variant(self, strategy: Strategy) -> PreTrainedModel:
        """`strategy`'s variant of the model, built at its first call (untimed)."""
        if strategy.name not in self.variants:
            self.variants[strategy.name] = strategy.model_variant(self.model)
        return self.variants[strategy.name]

    def _attempt(self, name: str, work: Callable[[], Any]) -> Any:
        """`work()`, or None when it raises and `name` may fail alone (not the baseline, `on_error` given)."""
        try:
            return work()
        except Exception as error:
            if self.on_error is None or name == self.baseline:
                raise
            self.failed.add(name)
            self.on_error(name, error)
            return None


def count_forwards(model: torch.nn.Module, run: Callable[[], Any]) -> int:
    """Forward calls of `model` (not its submodules) while `run()` executes."""
    calls = [0]
    handle = model.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    try:
        run()
    finally:
        handle.remove()
    return calls[0]


@contextlib.contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """Run the block with `num` torch CPU threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
