"""`hf-accel serve`: the OpenAI-compatible server on one model (the reference target by default, so it runs offline).

    hf-accel serve                                   # reference target on http://127.0.0.1:8000/v1
    hf-accel serve --model ./my-llama --quant int8 --api-key "$KEY" --port 9000
    hf-accel serve --medusa-heads PATH               # greedy requests speculate with Medusa heads from PATH
    hf-accel serve --speculative-config '{"method": "suffix", "num_speculative_tokens": 5}'   # vLLM's flag
    hf-accel serve --model ./docs-model              # a `hf-accel finetune` folder: its hf_accel.json is applied
    hf-accel serve --model ./base --lora-modules ft1=./adapter1 ft2=./adapter2   # `model: ft1` selects an adapter

The engine steps in a process of its own (`EngineProcess`), so the model step never waits on the server's Python
work; `--no-engine-process` keeps it in the server's process.

A model folder with an `hf_accel.json` (written by `hf-accel finetune`) is served with the weight preset and the
Medusa heads it names, unless `--quant` / `--medusa-heads` / `--speculative-config` are given.

Ctrl-C (SIGINT) or SIGTERM shuts down gracefully: no new connections, open requests get `--graceful-timeout`
seconds to finish, then the engine stops.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from collections.abc import Sequence
from pathlib import Path

import torch
import uvicorn

from ..arguments import parse_lora_modules
from ..engine.config import EngineConfig
from ..engine.lora_requests import LORA_METHODS
from ..engine.spec_decode.speculative_config import SpeculativeConfig
from ..lora.config import LoRAConfig
from ..quant.presets import list_quantization_presets
from ..speculative.medusa_heads import MedusaHeads
from ..serving_config import ServingConfig, read_serving_config
from .app import DEFAULT_MAX_QUEUE_LEN, create_app
from .served_engine import EngineSpec, serve_engine
from .speculative_option import EXAMPLE, parse_speculative_config

REFERENCE_NAME = "hf_accel-reference-target"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
API_KEY_ENV = "HF_ACCEL_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accel serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="causal LM folder, hub id or GGUF file (default: hf_accel's reference target)")
    parser.add_argument("--quant", default=None, metavar="PRESET",
                        choices=[preset.name for preset in list_quantization_presets()],
                        help="weight quantization preset, one of %(choices)s (default: the model folder's "
                             "hf_accel.json, else none)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="compute dtype (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require `Authorization: Bearer KEY` on the API routes (default: ${API_KEY_ENV}, "
                             "else no key)")
    parser.add_argument("--served-model-name", default=None,
                        help="the `model` clients send (default: --model, or hf_accel-reference-target)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences in a batch (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens a step (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus output (default: the model's max_position_embeddings)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV pool size, bytes or e.g. 2GiB (default: room for max-num-seqs full sequences)")
    _add_speculative_arguments(parser)
    _add_lora_arguments(parser)
    parser.add_argument("--enforce-eager", action="store_true", help="run the model step eagerly (default: compiled)")
    parser.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction, default=True,
                        help="serve with eager steps while the model step compiles in the background, then switch "
                             "(default: on; /health says 'compiling' meanwhile; --no-compile-in-background answers "
                             "only once compiled)")
    parser.add_argument("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
                        help="requests waiting for their first token before new ones get 429 (default: %(default)s)")
    _add_process_arguments(parser)
    return parser


def _add_process_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="step the engine in a process of its own, so the model never waits on the server's "
                             "Python work (default: on; --no-engine-process keeps it in the server's process)")
    parser.add_argument("--graceful-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish on shutdown (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--medusa-heads", default=None, metavar="PATH",
                        help="MedusaHeads.save_pretrained folder for --model: greedy requests verify the heads' "
                             "candidates (default: the model folder's hf_accel.json, else no speculation)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="with --medusa-heads: candidates per speculating step, at most the heads' count "
                             "(default: every head)")
    parser.add_argument("--max-speculative-batch-tokens", type=int, default=None,
                        help="with --medusa-heads: speculate while decoding sequences x (1 + candidates) stays "
                             "within this (default: 24)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding as vLLM's flag: a JSON object of SpeculativeConfig fields, e.g. "
                             f"'{EXAMPLE}'; methods ngram, suffix, medusa (model: the heads' folder), eagle3 "
                             "(model: an EAGLE head's folder), draft (model: a draft LM's folder)")


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (implied by --lora-modules and --allow-runtime-lora)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="peft adapter folders served from the start, each as NAME=PATH or a JSON object "
                             "'{\"name\": NAME, \"path\": PATH}'; a request's `model` NAME selects the adapter")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="adapters in one batch (resident at once; default: 8)")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (default: 64)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept read in memory (default: 32, at least --max-loras)")
    parser.add_argument("--allow-runtime-lora", action="store_true",
                        default=os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key; "
                             f"default: ${RUNTIME_LORA_ENV}, vLLM's switch, when 1 or true)")


def _lora(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LoRAConfig | None:
    """The engine's `LoRAConfig` (None without adapters; exits when a limit is given without them)."""
    limits = {name: getattr(args, name) for name in ("max_loras", "max_lora_rank", "max_cpu_loras")
              if getattr(args, name) is not None}
    if not (args.enable_lora or args.lora_modules or args.allow_runtime_lora):
        if limits:
            parser.error("--max-loras, --max-lora-rank and --max-cpu-loras need --enable-lora (or --lora-modules)")
        return None
    if "max_cpu_loras" not in limits:
        limits["max_cpu_loras"] = max(LoRAConfig.max_cpu_loras, limits.get("max_loras", LoRAConfig.max_loras))
    return _checked(parser, LoRAConfig, **limits)


def resolve_serving(path: str | None, quant: str | None, medusa_heads: str | None) -> tuple[str | None, Path | None]:
    """The weight preset and the Medusa heads folder to serve the model at `path` with: `quant` / `medusa_heads`
    where given, else what the folder's `hf_accel.json` names, else none."""
    found = (read_serving_config(path) if path is not None else None) or ServingConfig()
    heads = Path(medusa_heads) if medusa_heads is not None else found.heads_path(path) if path is not None else None
    return quant or found.quant, heads


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel serve`; returns once the server has shut down (1 if the engine failed to build)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    spec = engine_spec(parser, args)
    tokenizer = spec.tokenizer()
    load_failed: list[BaseException] = []

    def stop(error: BaseException) -> None:  # the engine could not be built: nothing to serve
        load_failed.append(error)
        server.should_exit = True

    # listening from the start: /health says "loading" while the engine is built
    app = create_app(partial(serve_engine, spec, tokenizer, in_process=not args.engine_process), tokenizer,
                     args.served_model_name or args.model or REFERENCE_NAME, api_key=args.api_key or None,
                     max_queue_len=args.max_queue_len, on_load_error=stop,
                     lora_modules=parse_lora_modules(parser, args.lora_modules),
                     allow_runtime_lora=args.allow_runtime_lora)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.graceful_timeout))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it held back once shut down (as `uvicorn.run` catches)
        pass
    return 1 if load_failed else 0


def engine_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineSpec:
    """The engine the parsed `args` ask for (exits with the reason when they conflict)."""
    quant, heads_path = resolve_serving(args.model, args.quant, args.medusa_heads)
    speculative = _speculative(parser, args)
    if speculative is not None:
        heads_path = None  # the flag decides, over the folder's hf_accel.json
    elif heads_path is None and (args.num_speculative_tokens or args.max_speculative_batch_tokens) is not None:
        parser.error("--num-speculative-tokens and --max-speculative-batch-tokens need --medusa-heads (or a model "
                     "folder whose hf_accel.json names heads); with --speculative-config, set them in its JSON")
    if heads_path is not None:
        heads = MedusaHeads.from_pretrained(heads_path, dtype=DTYPES[args.dtype])
        speculative = _checked(parser, SpeculativeConfig, "medusa", args.num_speculative_tokens, heads,
                               max_speculative_batch_tokens=args.max_speculative_batch_tokens)
    config = _checked(parser, EngineConfig, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                      max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                      compile_in_background=args.compile_in_background)
    lora = _lora(parser, args)
    if lora is not None and speculative is not None and speculative.method not in LORA_METHODS:
        parser.error(f"LoRA adapters are served with the speculative methods {', '.join(LORA_METHODS)}, not "
                     f"{speculative.method!r}")
    return EngineSpec(args.model, quant, DTYPES[args.dtype], args.threads, config, speculative, lora)


def _checked(parser: argparse.ArgumentParser, config_class: type, *args, **kwargs):
    """`config_class(*args, **kwargs)`, or exit with the reason it refuses them."""
    try:
        return config_class(*args, **kwargs)
    except (TypeError, ValueError) as error:
        parser.error(str(error))


def _speculative(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SpeculativeConfig | None:
    """`--speculative-config` parsed (exits with the reason when it is wrong, or given with --medusa-heads)."""
    if args.speculative_config is None:
        return None
    if args.medusa_heads is not None or args.num_speculative_tokens is not None \
            or args.max_speculative_batch_tokens is not None:
        parser.error("--speculative-config replaces --medusa-heads, --num-speculative-tokens and "
                     "--max-speculative-batch-tokens (use {\"method\": \"medusa\", \"model\": PATH, ...}); "
                     "pass one way")
    try:
        return parse_speculative_config(args.speculative_config, DTYPES[args.dtype])
    except ValueError as error:
        parser.error(str(error))
