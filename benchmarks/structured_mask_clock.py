"""bench_structured.py's clock of the grammar mask's host time: what filling (and, in the engine, applying) the masks
costs per masked row, timed by wrapping the engine sampler's `mask_rows` and the generate processor's `allowed`."""

from __future__ import annotations

import time
from typing import Any


class MaskClock:
    """Host seconds spent filling (and, in the engine, applying) grammar masks, and the rows masked (wraps the
    engine's `mask_rows` and the generate processor's `allowed`; compiled greedy generate applies the mask in its
    step)."""

    def __init__(self) -> None:
        self.seconds, self.rows = 0.0, 0

    def __enter__(self) -> MaskClock:
        import hf_accel.engine.sampler as sampler
        from hf_accel.structured.logits import StructuredLogitsProcessor

        self._saved = (sampler.mask_rows, StructuredLogitsProcessor.allowed)
        clock = self

        def mask_rows(logits, matchers):
            start = time.perf_counter()
            sampler_mask(logits, matchers)
            clock.seconds += time.perf_counter() - start
            clock.rows += sum(m is not None for m in matchers)

        def allowed(processor, input_ids, lengths=None, **options):
            start = time.perf_counter()
            out = processor_fill(processor, input_ids, lengths, **options)
            clock.seconds += time.perf_counter() - start
            clock.rows += input_ids.shape[0]
            return out

        sampler_mask, processor_fill = self._saved
        sampler.mask_rows, StructuredLogitsProcessor.allowed = mask_rows, allowed
        return self

    def __exit__(self, *exc: Any) -> None:
        import hf_accel.engine.sampler as sampler
        from hf_accel.structured.logits import StructuredLogitsProcessor

        sampler.mask_rows, StructuredLogitsProcessor.allowed = self._saved

    @property
    def microseconds_per_row(self) -> float | None:
        return 1e6 * self.seconds / self.rows if self.rows else None
