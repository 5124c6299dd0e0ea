"""bench_structured.py's clock of the grammar mask's host time: what filling (and, in the engine, the choice under)
the masks costs per masked row, timed by wrapping the engine sampler's `fill_rows` and `argmax_allowed` and the
generate processor's `allowed`."""

from __future__ import annotations

import time
from typing import Any


class MaskClock:
    """Host seconds spent filling grammar masks (and, in the engine, choosing under them: the greedy rows' masked
    argmax, the others' mask applied), and the rows masked (wraps the engine sampler's `fill_rows` and
    `argmax_allowed` and the generate processor's `allowed`; compiled greedy generate applies the mask in its
    step)."""

    def __init__(self) -> None:
        self.seconds, self.rows = 0.0, 0

    def __enter__(self) -> MaskClock:
        import hf_accel.engine.sampler as sampler
        from hf_accel.structured.logits import StructuredLogitsProcessor

        self._saved = (sampler.fill_rows, sampler.argmax_allowed, StructuredLogitsProcessor.allowed)
        clock = self

        def fill_rows(matchers, vocab_size):
            start = time.perf_counter()
            out = sampler_fill(matchers, vocab_size)
            clock.seconds += time.perf_counter() - start
            clock.rows += sum(m is not None for m in matchers)
            return out

        def argmax_allowed(logits, bitmask, rows):
            start = time.perf_counter()
            out = sampler_choice(logits, bitmask, rows)
            if rows:  # (with no row masked, the argmax an unconstrained step takes too)
                clock.seconds += time.perf_counter() - start
            return out

        def allowed(processor, input_ids, lengths=None, **options):
            start = time.perf_counter()
            out = processor_fill(processor, input_ids, lengths, **options)
            clock.seconds += time.perf_counter() - start
            clock.rows += input_ids.shape[0]
            return out

        sampler_fill, sampler_choice, processor_fill = self._saved
        sampler.fill_rows, sampler.argmax_allowed = fill_rows, argmax_allowed
        StructuredLogitsProcessor.allowed = allowed
        return self

    def __exit__(self, *exc: Any) -> None:
        import hf_accel.engine.sampler as sampler
        from hf_accel.structured.logits import StructuredLogitsProcessor

        sampler.fill_rows, sampler.argmax_allowed, StructuredLogitsProcessor.allowed = self._saved

    @property
    def microseconds_per_row(self) -> float | None:
        return 1e6 * self.seconds / self.rows if self.rows else None
