"""Checks shared by the caches' settings dataclasses: integer arguments, and `cache_config` dicts from generate."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any


def check_int(name: str, value: object, minimum: int, allowed: str) -> None:
    """TypeError unless `value` is an int (bools are not), ValueError below `minimum`; both name `name`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def settings_from_dict(settings_class: type, cache_config: Mapping[str, Any] | None, cache_name: str,
                       extra_keys: Iterable[str] = ()) -> dict[str, Any]:
    """A copy of generate's `cache_config` for `settings_class`: TypeError unless a dict (None means defaults),
    ValueError naming unknown keys and the allowed ones (its fields plus `extra_keys`)."""
    if cache_config is not None and not isinstance(cache_config, Mapping):
        raise TypeError(f"`cache_config` must be a dict of {cache_name} cache settings, "
                        f"got {type(cache_config).__name__}")
    options = dict(cache_config or {})
    allowed = {f.name for f in fields(settings_class)} | set(extra_keys)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"Unknown {cache_name} cache_config keys {unknown}; allowed keys are {sorted(allowed)}")
    return options
