"""Cache conformance suite: a cache against `DynamicCache` on tiny random models, one check per decoding mode.

Each check runs the same model and inputs twice, with the reference (generate's default `DynamicCache`) and with the
cache a `CacheSpec` selects, and asserts the cache type generate really used on each side (a registration bug
silently falls back to `DynamicCache`) and token-for-token equality. Every run sets `eos_token_id=None`,
`min_new_tokens` and `pad_token_id`, so a random model cannot stop early and make two caches look equal.

Usage: `MODES["beam_search"](make_model("llama", torch.float32, "sdpa"), spec)`, or call a `check_*` directly.
"""

from __future__ import annotations

import copy
import functools
import string
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (DynamicCache, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerFast, StoppingCriteria,
                          TextIteratorStreamer)
from transformers.cache_utils import Cache

from beam_ties import BeamSteps, beam_tie_gap

VOCAB_SIZE = 160
PAD, BOS, EOS, UNK = 0, 1, 2, 3  # special ids of the tiny tokenizer; prompts use ids >= FIRST_WORD
FIRST_WORD = 4
MAX_NEW_TOKENS = 16
SLIDING_WINDOW = 8  # shorter than every prompt + generation below, so windows are exercised
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)
_HYBRID = dict(sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"])

# name -> (config factory, attention implementations the architecture supports)
ARCHITECTURES: dict[str, tuple[Callable[[], transformers.PreTrainedConfig], tuple[str, ...]]] = {
    "llama": (lambda: transformers.LlamaConfig(**_COMMON), ("sdpa", "eager")),
    "mistral": (lambda: transformers.MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW),  # every layer sliding
                ("sdpa", "eager")),
    "qwen2": (lambda: transformers.Qwen2Config(**_COMMON, use_sliding_window=True, max_window_layers=1,
                                               sliding_window=SLIDING_WINDOW), ("sdpa", "eager")),  # full, sliding
    "qwen3": (lambda: transformers.Qwen3Config(**_COMMON), ("sdpa", "eager")),
    "gemma2": (lambda: transformers.Gemma2Config(**_COMMON, **_HYBRID, query_pre_attn_scalar=16), ("eager",)),
    "gemma3": (lambda: transformers.Gemma3TextConfig(**_COMMON, **_HYBRID, query_pre_attn_scalar=16),
               ("sdpa", "eager")),
    "phi3": (lambda: transformers.Phi3Config(**{k: v for k, v in _COMMON.items() if k != "head_dim"}),
             ("sdpa", "eager")),
}


@dataclass(frozen=True)
class CacheSpec:
    """How to make generate use the cache under test, and what to hold it to.

    `generate_kwargs` select the cache by name (`{"cache_implementation": "paged"}`); `cache_factory(model)` instead
    builds a cache passed as `past_key_values=` (the zero-patch path). `exact`: tokens equal the reference's; else
    every row agrees on its first `min_matching_tokens` generated tokens. `score_atol`: tolerance on scores and
    logits (default 1e-5 in fp32, 2e-2 in bf16). `check_shared_rows(cache, num_prompts, prompt_len)` is called on
    the returned cache where rows come in groups from `num_prompts` prompts of padded length `prompt_len` (20
    tokens; beams, `num_return_sequences`) and should assert each prompt is stored once. `reference`: the spec
    compared against (default: generate's own `DynamicCache`). `tie_atol` (lossy caches): tokens may first differ
    only where the reference's two best logits are within `tie_atol` of each other, a near tie the cache's error can
    flip; later tokens are not compared (the histories differ from there). `beam_tie_atol`: the same for beam search,
    whose decisions rank accumulated log-probs: tokens may differ only where the reference's scores of the beams the
    two runs first keep differently are within `beam_tie_atol` (tests/beam_ties.py).
    """

    name: str
    expected_type: type[Cache]
    generate_kwargs: Mapping[str, Any] = field(default_factory=dict)
    cache_factory: Callable[[PreTrainedModel], Cache] | None = None
    exact: bool = True
    min_matching_tokens: int = 1
    score_atol: float | None = None
    check_shared_rows: Callable[[Cache, int, int], None] | None = None
    reference: CacheSpec | None = None
    tie_atol: float | None = None
    beam_tie_atol: float | None = None

    def kwargs(self, model: PreTrainedModel) -> dict[str, Any]:
        """Generate kwargs that select this cache, with a fresh cache object per call."""
        made = {} if self.cache_factory is None else {"past_key_values": self.cache_factory(model)}
        return {**self.generate_kwargs, **made}

    @property
    def baseline(self) -> CacheSpec:
        return self.reference or REFERENCE

    def __str__(self) -> str:
        return self.name


REFERENCE = CacheSpec("dynamic", DynamicCache)

@functools.lru_cache(maxsize=None)
def make_model(arch: str, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """A tiny random-weight model (seed 0); its bf16 version is the fp32 model cast."""
    config = ARCHITECTURES[arch][0]()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def weights_packed_while(action: Callable[[], Any]) -> tuple[Any, int]:
    """`action()` with inductor's caches off (a cache hit skips the passes that pack weights) -> its result and how
    many Linear weights were packed meanwhile, for oneDNN by inductor's freezing or into panels by hf_accel's pass
    (`kernels/packed_linear.py`)."""
    import torch._dynamo.utils as dynamo_utils

    def count() -> int:
        return (dynamo_utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
                + dynamo_utils.counters["hf_accel"]["packed_linears"])

    before = count()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        result = action()
    return result, count() - before


@functools.lru_cache(maxsize=None)
def make_draft_model(model: PreTrainedModel, noise: float = 0.3) -> PreTrainedModel:
    """A draft for assisted decoding: `model` plus seeded noise (`noise` x each weight's std), so it agrees with
    `model` often but not always; it proposes 4 tokens every round (no confidence cut-off, no adaptive count)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            std = param.float().std().clamp_min(1e-3)
            param.copy_(param.float() + noise * std * torch.randn(param.shape, generator=gen))
    config = draft.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 4, "constant"  # no state across calls
    config.assistant_confidence_threshold = 0.0
    return draft


@functools.lru_cache(maxsize=None)
def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over the model vocabulary, built offline: letters and digits (StopStringCriteria
    needs them), then CJK characters (TextStreamer flushes after each, so streaming is incremental)."""
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits
    chars += "".join(chr(0x4E00 + i) for i in range(VOCAB_SIZE - FIRST_WORD - len(chars)))
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": UNK} | {c: FIRST_WORD + i for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def make_prompts(lengths: list[int], seed: int = 0, period: int | None = None) -> dict[str, torch.Tensor]:
    """Left-padded `input_ids` / `attention_mask` of the given lengths; `period` repeats a motif (prompt lookup)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens = torch.randint(FIRST_WORD, VOCAB_SIZE, (period or length,), generator=gen)
        ids[row, width - length :] = tokens.repeat(-(-length // tokens.numel()))[:length]
        mask[row, width - length :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def generate(model: PreTrainedModel, spec: CacheSpec, inputs: Mapping[str, torch.Tensor], **kwargs):
    """`model.generate` with the spec's cache, no EOS, raw logits kept (to diagnose differences); asserts the cache
    type generate used and, without stopping criteria, the full output length."""
    max_new = kwargs.pop("max_new_tokens", MAX_NEW_TOKENS)
    kwargs.setdefault("output_logits", True)
    out = model.generate(**inputs, **spec.kwargs(model), max_new_tokens=max_new, min_new_tokens=max_new,
                         eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True, **kwargs)
    used = type(out.past_key_values)
    assert used is spec.expected_type, f"{spec}: generate used {used.__name__}, expected {spec.expected_type.__name__}"
    if not {"stopping_criteria", "stop_strings"} & kwargs.keys():
        assert out.sequences.shape[1] == inputs["input_ids"].shape[1] + max_new, f"{spec}: generation ended early"
    return out


def compare(model: PreTrainedModel, spec: CacheSpec, inputs: Mapping[str, torch.Tensor], seed: int | None = None,
            **kwargs) -> tuple[Any, Any]:
    """Generate with the spec's reference, then with the spec (re-seeding torch before each when `seed` is set)."""
    outs = []
    for side in (spec.baseline, spec):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(generate(model, side, inputs, **kwargs))
    assert_same_tokens(outs[0], outs[1], spec, inputs["input_ids"].shape[1])
    return outs[0], outs[1]


def first_difference(reference, got) -> tuple[int, int] | None:
    """(row, column) of the earliest column where the outputs' sequences differ, or None."""
    assert got.sequences.shape == reference.sequences.shape, (
        f"output shape {tuple(got.sequences.shape)}, reference {tuple(reference.sequences.shape)}")
    differing = (reference.sequences != got.sequences).nonzero()
    return None if len(differing) == 0 else tuple(differing[differing[:, 1].argmin()].tolist())


def assert_same_tokens(reference, got, spec: CacheSpec, prompt_len: int,
                       tie: tuple[float | None, Callable[[], float]] | None = None) -> None:
    """Equal sequences (exact specs), else the first `min_matching_tokens` generated tokens equal in every row; a
    first difference passes at a near tie: `tie` = (tolerance, the reference's gap there), by default
    (`spec.tie_atol`, the gap of its top-2 raw logits at that token)."""
    found = first_difference(reference, got)
    if found is None or (not spec.exact and found[1] - prompt_len >= spec.min_matching_tokens):
        return
    row, step = found[0], found[1] - prompt_len
    atol, measure_gap = tie or (spec.tie_atol, lambda: _top2_gap(reference, row, step))
    gap = measure_gap()
    if atol is not None and gap <= atol:
        return
    raise AssertionError(
        f"{spec}: tokens differ from {spec.baseline} first at row {row}, generated token {step}"
        f"{_describe_logits(reference, got, row, step)}{'' if tie is None else f'; beam tie gap {gap:.3g}'}\n"
        f"reference  {reference.sequences.tolist()}\nunder test {got.sequences.tolist()}")


def _top2_gap(reference, row: int, step: int) -> float:
    """Gap between the reference's two best raw logits at (row, generated step); inf when rows are beams."""
    logits = reference.logits
    if not logits or step >= len(logits) or logits[step].shape[0] != reference.sequences.shape[0]:
        return float("inf")
    best = logits[step][row].float().topk(2).values
    return (best[0] - best[1]).item()


def _describe_logits(reference, got, row: int, step: int) -> str:
    logits = reference.logits
    if not logits or not got.logits or step >= len(logits) or logits[step].shape[0] != reference.sequences.shape[0]:
        return ""  # no logits, or their rows are beams rather than output rows
    ref, new = logits[step][row].float(), got.logits[step][row].float()
    top = ref.topk(2).indices.tolist()
    drift = max((a.float() - b.float()).abs().max().item() for a, b in zip(logits[: step + 1], got.logits))
    return (f"; raw logits there (token: logit) reference {dict(zip(top, ref[top].tolist()))}, under test "
            f"{dict(zip(top, new[top].tolist()))}; max |logit difference| up to there {drift:.3g}")


# ---- one check per decoding mode; each takes (model, spec) ----------------------------------------------------------

def check_greedy(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Greedy, batch 1, prompt + generation longer than the sliding window."""
    compare(model, spec, make_prompts([12]), do_sample=False)


def check_left_padded_batch(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Greedy over 4 left-padded prompts of different lengths."""
    compare(model, spec, make_prompts([5, 12, 9, 3], seed=1), do_sample=False)


def check_sampling(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Seeded multinomial sampling, batch 1."""
    compare(model, spec, make_prompts([10], seed=2), seed=1234, do_sample=True, top_k=0)


def check_sampling_multiple_sequences(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Seeded sampling, 2 left-padded prompts x 3 return sequences (rows of one prompt can share it)."""
    inputs = make_prompts([20, 17], seed=3)
    _, got = compare(model, spec, inputs, seed=99, do_sample=True, top_k=0, num_return_sequences=3)
    if spec.check_shared_rows is not None:
        spec.check_shared_rows(got.past_key_values, *inputs["input_ids"].shape)


def check_beam_search(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Beam search over 2 left-padded prompts, 4 beams, 2 returned sequences each; both runs' beam decisions are
    recorded, to measure the reference's scores where they first differ (`spec.beam_tie_atol`)."""
    inputs = make_prompts([20, 17], seed=4)
    records = (BeamSteps(), BeamSteps())
    reference, got = (generate(model, side, inputs, do_sample=False, num_beams=4, num_return_sequences=2,
                               logits_processor=LogitsProcessorList([record]))
                      for side, record in zip((spec.baseline, spec), records))
    num_prompts, prompt_len = inputs["input_ids"].shape
    assert_same_tokens(reference, got, spec, prompt_len, tie=(spec.beam_tie_atol, lambda: beam_tie_gap(
        *records, reference.sequences, got.sequences, num_prompts, prompt_len)))
    if spec.check_shared_rows is not None:
        spec.check_shared_rows(got.past_key_values, *inputs["input_ids"].shape)


def check_assisted_draft_model(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Assisted decoding with a draft model: partial acceptance, so the main cache is cropped by 0-4 tokens."""
    compare(model, spec, make_prompts([12], seed=5), do_sample=False, assistant_model=make_draft_model(model))


def check_prompt_lookup(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Prompt-lookup decoding over a prompt with a repeated motif, so candidates are proposed and verified."""
    compare(model, spec, make_prompts([18], seed=6, period=6), do_sample=False, prompt_lookup_num_tokens=3)


def check_streamer(model: PreTrainedModel, spec: CacheSpec) -> None:
    """`TextIteratorStreamer` fed by generate in a thread streams exactly the generated text; tokens equal the
    reference's too."""
    tokenizer, inputs = make_tokenizer(), make_prompts([10], seed=7)
    reference = generate(model, spec.baseline, inputs, do_sample=False)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=120)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = generate(model, spec, inputs, do_sample=False, streamer=streamer)
        except BaseException as error:  # re-raised in the test's thread
            result["error"] = error
            streamer.end()  # unblock the reader

    thread = threading.Thread(target=run)
    thread.start()
    chunks = list(streamer)
    thread.join()
    if "error" in result:
        raise result["error"]
    assert_same_tokens(reference, result["out"], spec, inputs["input_ids"].shape[1])
    expected = tokenizer.decode(result["out"].sequences[0, inputs["input_ids"].shape[1] :])
    assert "".join(chunks) == expected, f"{spec}: streamed {chunks}, expected {expected!r}"
    assert len(chunks) > 1, "the streamer was not exercised incrementally"


def check_stop_strings(model: PreTrainedModel, spec: CacheSpec, stop_at: int = 6) -> None:
    """`stop_strings=` (with `tokenizer=`) set to the character the reference generates at step `stop_at`."""
    tokenizer, inputs = make_tokenizer(), make_prompts([10], seed=8)
    prompt_len = inputs["input_ids"].shape[1]
    free = generate(model, spec.baseline, inputs, do_sample=False).sequences[0, prompt_len:].tolist()
    first = free.index(free[stop_at])
    stop = tokenizer.convert_ids_to_tokens(free[stop_at])
    reference, _ = compare(model, spec, inputs, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert reference.sequences.shape[1] == prompt_len + first + 1, "the stop string did not stop the reference"


class StopOnToken(StoppingCriteria):
    """Finishes row r once its last token is `token_ids[r]`."""

    def __init__(self, token_ids: torch.Tensor):
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token_ids.to(input_ids.device)


def check_stopping_criteria(model: PreTrainedModel, spec: CacheSpec, stop_at: tuple[int, ...] = (5, 2, 8)) -> None:
    """A custom `StoppingCriteria` finishing the rows of a left-padded batch at different steps (without EOS,
    generate keeps extending finished rows until the last row finishes)."""
    inputs = make_prompts([9, 4, 7], seed=9)
    prompt_len = inputs["input_ids"].shape[1]
    free = generate(model, spec.baseline, inputs, do_sample=False).sequences[:, prompt_len:]
    tokens = free[torch.arange(len(stop_at)), list(stop_at)]
    last_stop = max(row.tolist().index(int(token)) for row, token in zip(free, tokens))
    criteria = transformers.StoppingCriteriaList([StopOnToken(tokens)])
    reference, _ = compare(model, spec, inputs, do_sample=False, stopping_criteria=criteria)
    assert reference.sequences.shape[1] == prompt_len + last_stop + 1, "the criteria did not stop the reference"


def check_scores(model: PreTrainedModel, spec: CacheSpec) -> None:
    """`output_scores` and `output_logits` equal the reference's within `spec.score_atol`, at every step up to
    the first whose history differs (all steps for an exact spec)."""
    inputs = make_prompts([7, 11], seed=10)
    reference, got = compare(model, spec, inputs, do_sample=False, output_scores=True)
    atol = spec.score_atol if spec.score_atol is not None else (1e-5 if model.dtype == torch.float32 else 2e-2)
    found = first_difference(reference, got)
    num_steps = MAX_NEW_TOKENS if found is None else found[1] - inputs["input_ids"].shape[1] + 1
    for name in ("scores", "logits"):
        ref, new = getattr(reference, name), getattr(got, name)
        assert len(ref) == len(new) == MAX_NEW_TOKENS, f"{spec}: {len(new)} {name}, reference {len(ref)}"
        for step, (a, b) in enumerate(zip(ref[:num_steps], new)):
            diff = (a.float() - b.float()).abs().max().item()
            assert diff <= atol, f"{spec}: {name}[{step}] differ by {diff:.3g} (atol {atol})"


def check_continue_from_cache(model: PreTrainedModel, spec: CacheSpec) -> None:
    """Generate, append a 3-token user turn, generate again passing the returned cache as `past_key_values`."""
    inputs, turn = make_prompts([6, 11], seed=11), make_prompts([3, 3], seed=12)
    first = compare(model, spec, inputs, do_sample=False, max_new_tokens=8)
    if not torch.equal(first[0].sequences, first[1].sequences):
        return  # a near tie flipped in the first call (allowed by `spec.tie_atol`): the follow-ups differ by design
    outs = []
    for side, out in zip((spec.baseline, spec), first):
        generated = torch.ones_like(out.sequences[:, inputs["input_ids"].shape[1] :])
        follow_up = {"input_ids": torch.cat([out.sequences, turn["input_ids"]], dim=1),
                     "attention_mask": torch.cat([inputs["attention_mask"], generated, turn["attention_mask"]], 1)}
        cache = out.past_key_values
        again = generate(model, CacheSpec(side.name, side.expected_type), follow_up, do_sample=False,
                         past_key_values=cache)
        assert again.past_key_values is cache, f"{side}: generate replaced the cache it was given"
        outs.append(again)
    assert_same_tokens(outs[0], outs[1], spec, follow_up["input_ids"].shape[1])


MODES: dict[str, Callable[[PreTrainedModel, CacheSpec], None]] = {
    "greedy": check_greedy,
    "left_padded_batch": check_left_padded_batch,
    "sampling": check_sampling,
    "sampling_multiple_sequences": check_sampling_multiple_sequences,
    "beam_search": check_beam_search,
    "assisted_draft_model": check_assisted_draft_model,
    "prompt_lookup": check_prompt_lookup,
    "streamer": check_streamer,
    "stop_strings": check_stop_strings,
    "stopping_criteria": check_stopping_criteria,
    "scores": check_scores,
    "continue_from_cache": check_continue_from_cache,
}
