"""Argument types and parsers shared by the `hf-accel` subcommands' parsers (each subcommand owns its parser, in its
package): `at_least` (an int with a floor), `parse_lora_modules` (vLLM's `--lora-modules` entries, for `serve` and
`export`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= `minimum` (argparse reports anything else as a usage error naming the option)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def parse_lora_modules(parser: argparse.ArgumentParser, values: Sequence[str] | None) -> dict[str, str]:
    """`--lora-modules` as name -> folder (exits naming the entry that is neither NAME=PATH nor a JSON object with
    `name` and `path`, or a name given twice)."""
    modules: dict[str, str] = {}
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                name, path = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError):
                parser.error(f"--lora-modules entry {value!r} is not a JSON object with `name` and `path`")
        else:
            name, _, path = value.partition("=")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            parser.error(f"--lora-modules entry {value!r} must be NAME=PATH")
        if name in modules:
            parser.error(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules
