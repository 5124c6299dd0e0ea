"""What hf_accel's hook sees of every `model.generate` call before stock generate does (`registry.register`'s router):
`structured_output=` becomes a logits processor (`structured/generate_kwarg.py`), then calls that compile hf_accel's
caches or speculative loops are routed to the compiled loops (`compiled/route.py`)."""

from __future__ import annotations

from typing import Any

from .compiled.route import route_generate
from .structured.generate_kwarg import take_structured_output


def route(model: Any, kwargs: dict[str, Any]) -> None:
    """Edit one generate call's `kwargs` in place (see the module docstring)."""
    take_structured_output(model, kwargs)
    route_generate(model, kwargs)
