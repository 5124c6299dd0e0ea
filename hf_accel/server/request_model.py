"""`RequestModel`: the base of every request body: strict types, unknown fields ignored, `null` as the default."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class RequestModel(BaseModel):
    """Strict types; unknown fields ignored (as OpenAI-compatible servers do); `null` falls back to the default."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data
