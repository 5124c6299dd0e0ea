"""`hf-accel export`: write a model for another runtime.

    hf-accel export --format vllm out/target-bf16                 # the reference target + its EAGLE / Medusa heads
    hf-accel export --format vllm --quant int4 out/target-int4    # int4 weight-only (compressed-tensors)
    hf-accel export --format vllm --model ./my-model --quant int8 --eagle ./my-head out/my-model-int8
    hf-accel export --format vllm --model ./base --lora-modules sql=./sql docs=./docs out/base-loras  # + adapters

The folder gets `serve.sh` with the exact `vllm serve` command line (see docs/export.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..arguments import parse_lora_modules

FORMATS = ("vllm",)
QUANTS = ("int8", "int4")
SPECULATIVES = ("eagle3", "medusa", "none")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of `hf-accel export`; unknown `--format` / `--quant` values exit with an error naming the option."""
    parser = argparse.ArgumentParser(prog="hf-accel export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out", type=Path, nargs="?", help="folder to write (must be absent or empty unless "
                        "--overwrite)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="target runtime")
    parser.add_argument("--model", type=Path, default=None,
                        help="local model folder (default: hf_accel's reference target)")
    parser.add_argument("--quant", choices=QUANTS, default=None,
                        help="weight-only quantization in the compressed-tensors format (default: bf16 weights)")
    parser.add_argument("--medusa", type=Path, default=None,
                        help="Medusa heads folder to export under OUT/medusa (default: the reference heads when "
                             "exporting the reference target, else none)")
    parser.add_argument("--eagle", type=Path, default=None,
                        help="EAGLE head folder to export under OUT/eagle3 as vLLM's EAGLE-3 draft (default: the "
                             "reference head when exporting the reference target, else none)")
    parser.add_argument("--speculative", choices=SPECULATIVES, default=None,
                        help="what serve.sh speculates with (default: eagle3 when an EAGLE head is exported, else "
                             "medusa when heads are)")
    parser.add_argument("--served-model-name", default=None, help="name vLLM serves (default: OUT's folder name)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="peft LoRA adapter folders to export under OUT/loras/NAME, checked against the model; "
                             "serve.sh serves them with --enable-lora (the request's `model` NAME selects one; not "
                             "with --quant)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    args = parser.parse_args(argv)
    entries = args.lora_modules or []
    if args.out is None and entries and "=" not in entries[-1] and not entries[-1].lstrip().startswith("{"):
        args.out = Path(entries.pop())  # `--lora-modules A=X B=Y OUT`: the list took OUT, which is no NAME=PATH
    if args.out is None:
        parser.error("the following arguments are required: out")
    args.lora_modules = parse_lora_modules(parser, entries)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the export; bad paths print `hf-accel export: error: ...` and return 2."""
    args = parse_args(argv)
    from .vllm import export_vllm  # imported after parsing: --help stays fast

    try:
        out = export_vllm(args.out, model=args.model, quant=args.quant, medusa=args.medusa, eagle=args.eagle,
                          speculative=args.speculative, served_model_name=args.served_model_name,
                          overwrite=args.overwrite, lora_modules=args.lora_modules)
    except ValueError as error:
        print(f"hf-accel export: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if error.name != "compressed_tensors":
            raise
        print("hf-accel export: error: --quant needs compressed-tensors: pip install 'hf_accel[export]'",
              file=sys.stderr)
        return 2
    print(f"wrote {out}; serve it with: bash {out / 'serve.sh'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
