"""The JSON schemas bench_structured.py constrains outputs to, each with an example record, and its few-shot
extraction prompt: a comment naming the record kind, the example as JSON, then the start of the next record; the
requests of a batch (`prompts_for`) and how an output is judged (`check`)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

MAX_TOKENS = 160  # each constrained request's limit

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "schema": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,16}@[a-z0-9]{1,12}\\.(com|org|net)$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
            "required": ["name", "age", "email", "tags"], "additionalProperties": False},
        "example": {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "tags": ["math", "poetry"]}},
    "address": {
        "schema": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 32}, "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "DE", "FR", "JP", "BR"]}},
            "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        "example": {"street": "10 Main St", "city": "Springfield", "zip": "12345", "country": "US"}},
    "product": {
        "schema": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1}, "title": {"type": "string", "maxLength": 30},
            "price": {"type": "number", "minimum": 0}, "in_stock": {"type": "boolean"},
            "categories": {"type": "array", "items": {"enum": ["books", "garden", "tools", "toys"]},
                           "maxItems": 2}},
            "required": ["id", "title", "price", "in_stock", "categories"], "additionalProperties": False},
        "example": {"id": 7, "title": "Garden hose", "price": 19.5, "in_stock": True, "categories": ["garden"]}},
    "event": {
        "schema": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 30},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "attendees": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 16}, "role": {"enum": ["host", "guest", "speaker"]}},
                "required": ["name", "role"], "additionalProperties": False}}},
            "required": ["title", "date", "attendees"], "additionalProperties": False},
        "example": {"title": "Release party", "date": "2026-11-29",
                    "attendees": [{"name": "Sam", "role": "host"}]}},
    "order": {
        "schema": {"type": "object", "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}},
            "total": {"type": "number", "minimum": 0}},
            "required": ["order_id", "items", "total"], "additionalProperties": False},
        "example": {"order_id": "ORD-0042", "items": [{"sku": "A1", "qty": 2}], "total": 12.0}},
    "config": {
        "schema": {"type": "object", "properties": {
            "debug": {"type": "boolean"}, "level": {"enum": ["info", "warning", "error"]},
            "retries": {"type": "integer", "minimum": 0, "maximum": 5},
            "paths": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
            "required": ["debug", "level", "retries", "paths"], "additionalProperties": False},
        "example": {"debug": False, "level": "info", "retries": 3, "paths": ["/tmp"]}},
    "tool_call": {
        "schema": {"type": "object", "properties": {
            "name": {"enum": ["search", "fetch_url", "calculator"]},
            "arguments": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30}},
                          "required": ["query"], "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False},
        "example": {"name": "search", "arguments": {"query": "python dataclasses"}}},
    "book": {
        "schema": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 30}, "author": {"type": "string", "maxLength": 24},
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"}},
            "required": ["title", "author", "year", "isbn"], "additionalProperties": False},
        "example": {"title": "Dune", "author": "Frank Herbert", "year": 1965, "isbn": "9780441013593"}},
}


def extraction_prompt(name: str, variant: int = 0) -> str:
    """A few-shot prompt for a `name` record: its example as compact JSON, then `record = ` for the next one."""
    example = json.dumps(SCHEMAS[name]["example"])
    header = f"# {name} records, batch {variant}" if variant else f"# {name} records"
    return f"{header}\nrecord = {example}\nrecord = "


def prompts_for(tokenizer, batch: int) -> list[tuple[str, str]]:
    """`batch` (schema name, prompt) pairs: the extraction prompt of each schema in turn (its variant `i // 8`)."""
    names = list(SCHEMAS)
    return [(names[i % len(names)], extraction_prompt(names[i % len(names)], i // len(names))) for i in range(batch)]


def check(name: str, text: str, finish: str | None) -> str:
    """"valid", "invalid" or "unfinished" (cut by max_tokens)."""
    if finish != "stop":
        return "unfinished"
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name]["schema"])
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def tally(verdicts: list[str]) -> dict[str, int]:
    return {kind: verdicts.count(kind) for kind in ("valid", "invalid", "unfinished")}
