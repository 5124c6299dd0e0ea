"""`python -m hf_accel.reference.held_out_command`: rebuild the shipped held-out text (``held_out.py``) from this
interpreter's standard library, its tokens counted with the reference tokenizer.

Run it with the Python version that ``provenance.json`` states to reproduce the shipped files byte for byte; another
version's stdlib gives other texts (and a new fingerprint), which would change every benchmark's prompts.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from . import ASSETS_DIR
from .held_out import HELD_OUT_DIR, LICENCE_NAME, stdlib_held_out, write_held_out
from .sources import stdlib_source


def main(argv: Sequence[str] | None = None) -> int:
    """Write ``files.jsonl``, ``LICENSE.txt`` and ``provenance.json`` into ``--out``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m hf_accel.reference.held_out_command", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HELD_OUT_DIR, help="folder to write (default: the package's)")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer", local_files_only=True)
    stdlib = stdlib_source()
    licence_text = (stdlib.root / LICENCE_NAME).read_text(encoding="utf-8")
    provenance = write_held_out(stdlib_held_out(stdlib), licence_text, tokenizer, args.out)
    print(json.dumps(provenance, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
