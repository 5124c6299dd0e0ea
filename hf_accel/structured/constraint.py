"""`StructuredOutput`: what a generated text must match (vLLM's `StructuredOutputsParams` names): a JSON schema, any
JSON object, a regular expression, one of a few strings, an EBNF grammar, or a structural tag (free text in which
spans opened by trigger strings follow their own constraints: tool calls)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint on the generated text.

    Args:
        json: a JSON schema (a dict, its JSON text, or a Pydantic model class): the output is one JSON value that
            validates against it.
        json_object: True: the output is any JSON object.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, as vLLM's `grammar`) whose `root` rule the output matches.
        structural_tag: an xgrammar structural tag (a dict or its JSON text, as vLLM's `structural_tag`), e.g. free
            text in which each `<tool_call>` opens a call whose arguments fit the function's JSON schema:
            `{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags":
            [{"begin": "<tool_call>{\"name\": \"f\", \"arguments\": ", "content": {"type": "json_schema",
            "json_schema": {...}}, "end": "}</tool_call>"}]}}`.
        jump_forward: where the grammar allows exactly one continuation (a JSON key, closing brackets), verify those
            tokens in one forward instead of generating them one at a time (jump-forward decoding; outputs are those
            of constrained decoding without it, exactly for greedy, in distribution for sampling). On by default;
            in the Engine it also needs `EngineConfig.structured_jump_forward` (on by default).

    Generation stops where the constraint is complete (the model's EOS is the only token allowed then); a
    `max_new_tokens` reached first leaves it unfinished, as in vLLM.
    """

    json: dict[str, Any] | str | type | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    jump_forward: bool = True

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if (getattr(self, kind) not in (None, False))]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        for name in ("json_object", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}")
        if self.json is not None and not (isinstance(self.json, (dict, str)) or _is_pydantic_model(self.json)):
            raise TypeError(f"`json` must be a JSON schema (a dict or its JSON text) or a Pydantic model class, got "
                            f"{type(self.json).__name__}")
        if self.structural_tag is not None and not (isinstance(self.structural_tag, dict) or (
                isinstance(self.structural_tag, str) and self.structural_tag)):
            raise TypeError(f"`structural_tag` must be a dict or its non-empty JSON text, got {self.structural_tag!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"`{name}` must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or \
                    not all(isinstance(item, str) and item for item in self.choice):
                raise TypeError(f"`choice` must be a non-empty list of non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached under. A schema's text keeps its keys' order, which the
        grammar follows (properties come out in the order the schema declares them)."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.schema())
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "structural_tag":
            return kind, self.structural_tag_text()
        return kind, getattr(self, kind)

    def structural_tag_text(self) -> str:
        """The structural tag as JSON text (a dict's keys in their order)."""
        tag = self.structural_tag
        return tag if isinstance(tag, str) else json.dumps(tag)

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a `json` constraint as a dict (a Pydantic class's `model_json_schema()`); ValueError
        when its text is not JSON."""
        if _is_pydantic_model(self.json):
            return self.json.model_json_schema()
        if isinstance(self.json, str):
            try:
                return json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"`json` is not valid JSON: {error}") from error
        return self.json


def _is_pydantic_model(value: Any) -> bool:
    return isinstance(value, type) and hasattr(value, "model_json_schema")


StructuredOutputsParams = StructuredOutput  # vLLM's name, as `SamplingParams(structured_outputs=...)` takes it
