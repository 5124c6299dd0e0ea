"""Argument types shared by the `hf-accel` subcommands' parsers (each subcommand owns its parser, in its package)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= `minimum` (argparse reports anything else as a usage error naming the option)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse
