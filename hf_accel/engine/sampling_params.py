"""`SamplingParams`: how one request is decoded, with vLLM's names and defaults (`temperature=0` is greedy).

Every field is checked on construction, so nothing a client sends can fail later for a reason known up front: numbers
must be finite and in range, `seed` fits in 63 bits, and the lists have caps (`MAX_STOP_STRINGS` strings of at most
`MAX_STOP_CHARS` characters, `MAX_STOP_TOKEN_IDS` ids, `MAX_LOGPROBS` alternatives). Limits that depend on the engine
(`n` against `max_num_seqs`, `n * (prompt + max_tokens)` against the KV cache) are the engine's checks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..cache.settings import check_int
from ..structured.constraint import StructuredOutput

MAX_SEED = 2**63  # exclusive: a seed is a non-negative int64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # vLLM's default `max_logprobs`
MIN_TEMPERATURE = 1e-2  # smaller non-zero temperatures are raised to it, as vLLM does (else logits overflow)


def _check_number(name: str, value: object, low: float, high: float | None, allowed: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _check_int_list(name: str, value: object, max_len: int) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"`{name}` must be a list of token ids (ints), got {value!r}")
    if len(value) > max_len:
        raise ValueError(f"`{name}` may hold at most {max_len} token ids, got {len(value)}")
    if any(not 0 <= v < MAX_SEED for v in value):
        raise ValueError(f"`{name}` must hold token ids in [0, 2**63), got {value!r}")
    return list(value)


def _check_below(name: str, value: object, low: int, stop: int, allowed: str) -> None:
    check_int(name, value, low, allowed)
    if value >= stop:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _check_stop(value: object) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise TypeError(f"`stop` must be a string or a list of non-empty strings, got {value!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"`stop` may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"`stop` strings may be at most {MAX_STOP_CHARS} characters long")
    return list(stops)


def _check_structured_outputs(value: object) -> StructuredOutput | None:
    """The constraint, a Pydantic model class replaced by its JSON schema (so the params pickle to the engine-core
    process as plain data)."""
    if value is None:
        return None
    if not isinstance(value, StructuredOutput):
        raise TypeError(f"`structured_outputs` must be a StructuredOutputsParams (hf_accel.StructuredOutput) or "
                        f"None, got {type(value).__name__}")
    if value.kind == "json" and not isinstance(value.json, (dict, str)):
        return dataclasses.replace(value, json=value.schema())
    return value


@dataclass(slots=True)
class SamplingParams:
    """Decoding settings of one request; rows of one engine step may each have their own.

    Args:
        max_tokens: most new tokens to generate.
        temperature: 0 is greedy; otherwise logits are divided by it before sampling (values below 0.01 count as
            0.01, as in vLLM: smaller ones overflow the logits).
        top_p: keep the smallest set of tokens whose probability reaches `top_p` (1 disables).
        top_k: keep the `top_k` most likely tokens (0 disables).
        min_p: drop tokens whose probability is below `min_p` times the top token's (0 disables).
        repetition_penalty: transformers' multiplicative penalty on tokens already in prompt or output (1 disables).
        stop: strings that end generation; the returned text stops before them (at most 16, of at most 256
            characters each).
        stop_token_ids: token ids that end generation (kept as the last output token, like EOS); at most 1024.
        ignore_eos: keep generating after the model's end-of-sequence token.
        seed: per-request random seed in [0, 2**63): the same request and seed give the same sample, whatever else
            is batched.
        n: number of samples for the prompt (sample `i` uses `seed + i` when seeded).
        logprobs: when set, return the chosen token's log-probability and the top `logprobs` alternatives (at most
            20).
        priority: lower runs first (vLLM's convention); ties go by arrival.
        structured_outputs: a `StructuredOutputsParams` (`hf_accel.StructuredOutput`): the output matches its JSON
            schema, JSON object, regex, choice or grammar, and ends where the constraint is complete (needs the
            `structured` extra and the engine's tokenizer; docs/structured_outputs.md).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    priority: int = 0
    structured_outputs: StructuredOutput | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, "a positive int")
        _check_number("temperature", self.temperature, 0.0, None, "a finite number >= 0 (0 is greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        _check_number("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]")
        if self.top_p == 0:
            raise ValueError("`top_p` must be a number in (0, 1], got 0")
        check_int("top_k", self.top_k, 0, "an int >= 0 (0 disables)")
        _check_number("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, None, "a finite number > 0")
        if self.repetition_penalty == 0:
            raise ValueError("`repetition_penalty` must be a finite number > 0, got 0")
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_int_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"`ignore_eos` must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            _check_below("seed", self.seed, 0, MAX_SEED, "an int in [0, 2**63) or None")
        check_int("n", self.n, 1, "a positive int")
        if self.logprobs is not None:
            _check_below("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1, f"an int in [0, {MAX_LOGPROBS}] or None")
        _check_below("priority", self.priority, -MAX_SEED, MAX_SEED, "an int in [-2**63, 2**63)")
        self.structured_outputs = _check_structured_outputs(self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_processing(self) -> bool:
        """Whether logits go through processors before the argmax / draw (anything beyond plain greedy)."""
        return not self.is_greedy or self.repetition_penalty != 1.0
