"""`SamplingParams`: how one request is decoded, with vLLM's names and defaults (`temperature=0` is greedy)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.settings import check_int


def _check_number(name: str, value: object, low: float, high: float | None, allowed: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _check_int_list(name: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"`{name}` must be a list of token ids (ints), got {value!r}")
    if any(v < 0 for v in value):
        raise ValueError(f"`{name}` must hold non-negative token ids, got {value!r}")
    return list(value)


@dataclass(slots=True)
class SamplingParams:
    """Decoding settings of one request; rows of one engine step may each have their own.

    Args:
        max_tokens: most new tokens to generate.
        temperature: 0 is greedy; otherwise logits are divided by it before sampling.
        top_p: keep the smallest set of tokens whose probability reaches `top_p` (1 disables).
        top_k: keep the `top_k` most likely tokens (0 disables).
        min_p: drop tokens whose probability is below `min_p` times the top token's (0 disables).
        repetition_penalty: transformers' multiplicative penalty on tokens already in prompt or output (1 disables).
        stop: strings that end generation; the returned text stops before them.
        stop_token_ids: token ids that end generation (kept as the last output token, like EOS).
        ignore_eos: keep generating after the model's end-of-sequence token.
        seed: per-request random seed: the same request and seed give the same sample, whatever else is batched.
        n: number of samples for the prompt (sample `i` uses `seed + i` when seeded).
        logprobs: when set, return the chosen token's log-probability and the top `logprobs` alternatives.
        priority: lower runs first (vLLM's convention); ties go by arrival.
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

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, "a positive int")
        _check_number("temperature", self.temperature, 0.0, None, "a number >= 0 (0 is greedy)")
        _check_number("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]")
        if self.top_p == 0:
            raise ValueError("`top_p` must be a number in (0, 1], got 0")
        check_int("top_k", self.top_k, 0, "an int >= 0 (0 disables)")
        _check_number("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, None, "a number > 0")
        if self.repetition_penalty == 0:
            raise ValueError("`repetition_penalty` must be a number > 0, got 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise TypeError(f"`stop` must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = _check_int_list("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"`ignore_eos` must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            check_int("seed", self.seed, 0, "a non-negative int or None")
        check_int("n", self.n, 1, "a positive int")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, "an int >= 0 or None")
        check_int("priority", self.priority, -(2**63), "an int")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_processing(self) -> bool:
        """Whether logits go through processors before the argmax / draw (anything beyond plain greedy)."""
        return not self.is_greedy or self.repetition_penalty != 1.0
