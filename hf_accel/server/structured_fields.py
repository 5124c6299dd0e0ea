"""The request fields that constrain output, as the engine's `StructuredOutput`:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}` (JSON valid under `schema`;
  strict or not, the output is constrained; without `schema`, any JSON object);
- vLLM's `structured_outputs`: exactly one of `json` (a schema), `json_object`, `regex`, `choice`, `grammar`,
  `structural_tag` (xgrammar's structural tag, a dict or its JSON text).

Keys this server does not honour (vLLM's `whitespace_pattern`, ...) are a 400 naming them, never dropped. A request
may use one of the two fields, not both.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from ..structured.constraint import StructuredOutput
from .request_model import RequestModel


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: `schema` is the JSON schema itself."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # optional in OpenAI's API
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('`json_schema` is required with type "json_schema" and only allowed with it')
        return self

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":  # without a schema: any JSON object
            schema = self.json_schema.json_schema
            return StructuredOutput(json_object=True) if schema is None else StructuredOutput(json=schema)
        return None


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs` (exactly one constraint)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def constraint(self) -> StructuredOutput:
        """ValueError / TypeError naming `structured_outputs` unless exactly one constraint is given."""
        try:
            return StructuredOutput(json=self.json_schema, json_object=bool(self.json_object), regex=self.regex,
                                    choice=self.choice, grammar=self.grammar, structural_tag=self.structural_tag)
        except (ValueError, TypeError) as error:
            raise type(error)(f"`structured_outputs`: {error}") from error


def request_constraint(response_format: ResponseFormat | None,
                       structured_outputs: StructuredOutputsField | None) -> StructuredOutput | None:
    """The request's constraint, from whichever of the two fields sets one; ValueError naming both when both do."""
    from_format = response_format.constraint() if response_format is not None else None
    if from_format is not None and structured_outputs is not None:
        raise ValueError("give one of `response_format` (json_object, json_schema) and `structured_outputs`, not both")
    return from_format if structured_outputs is None else structured_outputs.constraint()
