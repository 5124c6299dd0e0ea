"""Speculative decoding under `compile_config` (`hf_accel/compiled/target_rounds.py`, `ngram_loop.py`,
`draft_loop.py`): `ngram_generate` and `draft_generate` verify (and draft) with compiled forwards over static paged
pools, rejected K/V rolled back by position. Greedy output equals plain greedy `generate` token for token, batch 1
and left-padded batches, Llama and Gemma 2 (hybrid sliding / full), with candidates really accepted; EOS stops and
pads each row as transformers does; the round's k varies without recompiling; uncovered calls decode eagerly with a
warning; the row bookkeeping is exact."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig
from transformers.generation.streamers import BaseStreamer

from conformance import PAD, make_draft_model, make_model, make_prompts
from hf_accel import SpeculativeStats, SuffixCache, draft_generate, ngram_generate
from hf_accel.compiled.spec_rows import RowTokens
from hf_accel.compiled import captured_step, draft_loop, target_rounds
from hf_accel.compiled.target_rounds import TargetRounds

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
NEW = 24
CASES = {"llama batch 1": ("llama", [14]), "llama left-padded batch 3": ("llama", [6, 17, 11]),
         "gemma2 batch 1": ("gemma2", [14]), "gemma2 left-padded batch 3": ("gemma2", [6, 17, 11])}


def _model(arch):
    return make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")


def _plain(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, **kwargs)


def _ngram(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("draft_token_cost", 0.0)  # verify every draft: the acceptance paths are what is tested
    kwargs.setdefault("compile_config", COMPILE)
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, custom_generate=ngram_generate, **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_compiled_ngram_equals_plain_greedy(case):
    arch, lengths = CASES[case]
    model = _model(arch)
    stats = SpeculativeStats()
    for seed in (1, 2):
        inputs = make_prompts(lengths, seed=seed, period=4)  # repeating prompts: prompt lookup finds matches
        out = _ngram(model, inputs, ngram_stats=stats, return_dict_in_generate=True)
        assert out.past_key_values is None  # the compiled loop ran (the eager one returns generate's cache)
        assert torch.equal(out.sequences, _plain(model, inputs)), f"seed {seed}"
    assert sum(stats.accepted) > 0 and stats.tokens_per_forward > 1
    assert 0 < stats.acceptance_rate < 1 or len(lengths) == 1


def test_compiled_ngram_eos_pads_finished_rows_and_keeps_the_off_switch():
    model = _model("llama")
    inputs = make_prompts([9, 15, 5], seed=5, period=3)
    free = _plain(model, inputs)
    eos = int(free[1, -10])  # a token row 1 emits mid-way: it stops there, later rows are padded
    expected = _plain(model, inputs, eos_token_id=eos)
    assert torch.equal(_ngram(model, inputs, eos_token_id=eos), expected)
    off = SpeculativeStats()  # a measured budget on prompts with nothing to copy: mostly plain compiled steps
    random = make_prompts([9, 15, 5], seed=6)
    assert torch.equal(_ngram(model, random, ngram_stats=off, draft_token_cost=None), _plain(model, random))
    assert off.draft_lengths.count(0) > len(off.draft_lengths) // 2


def test_compiled_ngram_k_varies_without_recompiling_and_shares_the_suffix_cache():
    model = _model("llama")
    inputs = make_prompts([8, 13], seed=7, period=5)
    _ngram(model, inputs)  # traces the verify and decode graphs for batch > 1
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    shared, stats = SuffixCache(), SpeculativeStats()
    for lengths, seed in (([8, 13], 8), ([5, 21, 4], 9), ([5, 21, 4], 9)):
        prompts = make_prompts(lengths, seed=seed, period=5)
        got = _ngram(model, prompts, suffix_cache=shared, ngram_stats=stats, max_new_tokens=30)
        assert torch.equal(got, _plain(model, prompts, max_new_tokens=30))
    assert len({n for n in stats.draft_lengths if n}) > 2  # several k
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before
    assert shared.num_sequences == 8  # every row of every call


def test_uncovered_ngram_calls_decode_eagerly_with_a_warning():
    model = _model("llama")
    inputs = make_prompts([10], seed=3, period=4)
    with pytest.warns(UserWarning, match="RepetitionPenaltyLogitsProcessor"):
        got = _ngram(model, inputs, repetition_penalty=1.2, return_dict_in_generate=True)
    assert got.past_key_values is not None
    assert torch.equal(got.sequences, _plain(model, inputs, repetition_penalty=1.2))


def test_row_tokens_stop_at_eos_and_budget_and_pad():
    rows = RowTokens.empty(3, max_new_tokens=4, eos_token_ids=[2])
    assert [rows.emit(0, [5, 6]), rows.emit(1, [7, 2, 9]), rows.emit(2, [1, 1, 1, 1, 1])] == [2, 2, 4]
    assert rows.finished == [False, True, True] and rows.remaining == [2, 0, 0]
    assert rows.emit(0, [8, 9, 10]) == 2 and rows.is_done
    prompts = torch.tensor([[0, 3], [4, 4], [0, 0]])
    assert rows.sequences(prompts, pad_token_id=0).tolist() == [
        [0, 3, 5, 6, 8, 9], [4, 4, 7, 2, 0, 0], [0, 0, 1, 1, 1, 1]]


def _draft(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("compile_config", COMPILE)
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, custom_generate=draft_generate,
                          draft_model=make_draft_model(model), **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_compiled_draft_model_equals_plain_greedy(case):
    arch, lengths = CASES[case]
    model = _model(arch)
    stats = SpeculativeStats()
    for seed in (1, 2):
        inputs = make_prompts(lengths, seed=seed)
        out = _draft(model, inputs, draft_stats=stats, return_dict_in_generate=True)
        assert out.past_key_values is None  # the compiled loop ran (the eager one returns generate's cache)
        assert torch.equal(out.sequences, _plain(model, inputs)), f"seed {seed}"
    assert 0 < stats.acceptance_rate < 1 and stats.num_draft_forwards > stats.num_target_forwards
    assert len(set(stats.draft_lengths)) > 1  # k adapted between rounds


def test_compiled_draft_model_eos_and_streamer():
    model = _model("llama")
    inputs = make_prompts([9, 15, 5], seed=5)
    eos = int(_plain(model, inputs)[2, -12])
    assert torch.equal(_draft(model, inputs, eos_token_id=eos), _plain(model, inputs, eos_token_id=eos))
    streamer, one = Collect(), make_prompts([11], seed=4)
    out = _draft(model, one, streamer=streamer)
    assert streamer.ended and [t for chunk in streamer.chunks for t in chunk] == out[0].tolist()


def test_compiled_draft_model_never_compiles_a_plain_round(monkeypatch):
    """The last round (no row may gain two tokens) verifies a draft it counts as none instead of a plain decode step,
    whose graph would be compiled for that one token."""
    model = _model("llama")

    def refuse(self):
        raise AssertionError("the draft loop took a plain round")

    monkeypatch.setattr(TargetRounds, "plain_round", refuse)
    for new in (2, 5, NEW):
        inputs = make_prompts([8, 13], seed=new)
        stats = SpeculativeStats()
        out = _draft(model, inputs, max_new_tokens=new, draft_stats=stats)
        assert torch.equal(out, _plain(model, inputs, max_new_tokens=new))
        assert stats.num_new_tokens == 2 * new


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_compiled_draft_model_with_the_gpu_attention_rule(monkeypatch):
    """Without the CPU kernel (a GPU), every compiled step attends through `decode_attention`, n queries per row,
    traced whole: still plain greedy's tokens (its windows and softcap are checked against the kernel in
    test_cuda_graphs.py)."""
    monkeypatch.setattr(target_rounds, "paged_attention_kernel", lambda: None)
    model = _model("llama")
    inputs = make_prompts([6, 17, 11], seed=3)
    stats = SpeculativeStats()
    assert torch.equal(_draft(model, inputs, draft_stats=stats), _plain(model, inputs))
    assert sum(stats.accepted) > 0


class RecordedGraph:
    """Stands in for `captured_step.CapturedStep` off a GPU: records the shape it was built for and each call, and
    runs the step itself (what a replay of its graph computes)."""

    built: list[tuple[int, tuple[int, ...]]] = []  # (id of the step, shape of its first input)
    calls: list[tuple[int, tuple[int, ...]]] = []

    def __init__(self, step, *inputs):
        self.step = step
        RecordedGraph.built.append((id(step), tuple(inputs[0].shape)))

    def __call__(self, *inputs):
        RecordedGraph.calls.append((id(self.step), tuple(inputs[0].shape)))
        return self.step(*inputs)

    @classmethod
    def install(cls, monkeypatch, *loops) -> None:
        """Record every graph the `loops` modules would capture for mode "reduce-overhead", at each shape's first
        call (as if on a GPU)."""
        monkeypatch.setattr(captured_step, "CapturedStep", cls)
        monkeypatch.setattr(captured_step, "CAPTURE_AT", 1)
        for module in loops:
            monkeypatch.setattr(module, "captures", lambda device, mode: mode == "reduce-overhead")
        cls.built, cls.calls = [], []

    @classmethod
    def assert_one_per_shape_and_replayed(cls) -> list[tuple[int, ...]]:
        """One graph per forward and shape, every call through one, called again after it was built -> the shapes
        of the graphs' first inputs."""
        assert len(cls.built) == len(set(cls.built)) and set(cls.calls) == set(cls.built)
        assert len(cls.calls) > len(cls.built)
        return [shape for _, shape in cls.built]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_where_graphs_are_captured_each_forward_shape_gets_one_and_replays_it(monkeypatch, method):
    """With CUDA graphs asked for (a GPU, mode "reduce-overhead"), the target's verify (one graph per number of
    candidates) and plain steps, and the draft's pair and single steps, each go through one captured graph per
    shape, built once and called every round after."""
    RecordedGraph.install(monkeypatch, target_rounds, draft_loop)
    model = _model("llama")
    inputs = make_prompts([6, 17, 11], seed=3, period=4)
    run = _ngram if method == "ngram" else _draft
    out = run(model, inputs, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert torch.equal(out, _plain(model, inputs))
    shapes = RecordedGraph.assert_one_per_shape_and_replayed()
    assert any(len(shape) == 2 and shape[1] > 2 for shape in shapes)  # the target's verify of 1 + k, k > 1
    if method == "draft":
        assert (3, 2) in shapes and (3,) in shapes  # the draft's pair forward and its single steps


def test_a_shape_is_captured_at_its_third_call_and_replayed_after(monkeypatch):
    monkeypatch.setattr(captured_step, "CapturedStep", RecordedGraph)
    RecordedGraph.built, RecordedGraph.calls = [], []
    ran = []
    steps = captured_step.CapturedSteps(lambda tokens, at: ran.append(tuple(tokens.shape)) or tokens + at, True)
    rows, three = torch.zeros(2, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    for _ in range(4):
        assert torch.equal(steps(three, rows[:, None]), three)
    steps(torch.ones(2, 5, dtype=torch.long), rows[:, None])  # a shape seen once runs as is
    assert [shape for _, shape in RecordedGraph.built] == [(2, 3)]
    assert [shape for _, shape in RecordedGraph.calls] == [(2, 3), (2, 3)]  # the third and fourth calls
    assert len(ran) == 5
    off = captured_step.CapturedSteps(lambda tokens, at: tokens, False)
    for _ in range(4):
        off(three, rows)
    assert len(RecordedGraph.built) == 1  # not enabled: never captured
