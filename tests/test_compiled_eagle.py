"""`eagle_generate` under `compile_config` (`hf_accel/compiled/eagle_loop.py`): the target's verify forward and the
head's passes compiled over static paged pools. Greedy output equals plain greedy `generate` token for token at batch
1 and in left-padded batches (rows accepting different numbers of drafts), on Llama and Qwen 3 with a trained head and
on Gemma 2 (hybrid sliding / full, which the eager loop refuses at batch > 1); every round's first draft equals the
head's prediction computed from scratch over the row's tokens (the head pool's entry layout is exact); k varies
without new graphs; EOS and a streamer; sampling is lossless (chi-square against plain sampling); other logits
processors decode eagerly with a warning."""

import copy

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from conformance import PAD, make_model, make_prompts
from test_eagle_generate import model_for, own_text, trained_head
from test_compiled_speculation import Collect, RecordedGraph
from test_eagle_sampling import NUM_EAGLE, check_columns, peaked_model_and_head
from test_medusa_sampling import NUM_PLAIN, PROMPT
from transformers import CompileConfig

from hf_accel import EagleHead, SpeculativeStats, eagle_generate
from hf_accel.compiled import eagle_loop, target_rounds
from hf_accel.speculative.draft_length import DraftLength
from hf_accel.training.eagle_features import target_features
from hf_accel.training.eagle_unroll import unrolled_hidden

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
NEW = 24


def _eagle(model, head, inputs, compiled=True, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **kwargs}
    if compiled:
        kwargs.setdefault("compile_config", COMPILE)
    return model.generate(**inputs, custom_generate=eagle_generate, eagle_head=head, **kwargs)


def _plain(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)


def _own_prompts(model, lengths):
    """Left-padded prompts cut from the text the head was trained on (it drafts them well)."""
    text = own_text(model)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = text[row, :length]
        mask[row, width - length :] = 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lengths", [[9], [5, 12, 3]])
def test_compiled_eagle_equals_plain_greedy(arch, lengths):
    model = model_for(arch)
    stats = SpeculativeStats()
    for inputs in (_own_prompts(model, lengths), make_prompts(lengths, seed=3)):
        out = _eagle(model, trained_head(model), inputs, eagle_stats=stats, return_dict_in_generate=True)
        assert out.past_key_values is None  # the compiled loop ran (the eager one returns generate's cache)
        assert torch.equal(out.sequences, _plain(model, inputs))
    assert stats.accepted[0] > 0 and stats.tokens_per_forward > 1.1, stats
    assert stats.num_draft_forwards > 0


def test_compiled_eagle_on_a_sliding_window_model_at_batch_3():
    model = make_model("gemma2", torch.float32, "eager")
    head = EagleHead.for_model(model)  # untrained: few drafts accepted, but the output must not change
    inputs = make_prompts([6, 17, 11], seed=4, period=4)
    assert torch.equal(_eagle(model, head, inputs, min_draft_probability=0.0), _plain(model, inputs))


def test_every_first_draft_equals_the_uncached_head(monkeypatch):
    """At every round, the head's draft 1 for each generating row equals its step-0 prediction over the row's tokens
    so far (prompt without padding, then its output), computed from scratch without any cache."""
    model = model_for("llama")
    head = trained_head(model)
    seen = []
    original = eagle_loop._round

    def recording(target, rounds, length):
        rows = [torch.cat([prompt, torch.tensor(out, dtype=torch.long)]) for prompt, out in
                zip(target.prompts, target.outputs.generated)]
        seen.append((rows, list(target.outputs.finished), rounds.last.token.clone()))
        original(target, rounds, length)

    monkeypatch.setattr(eagle_loop, "_round", recording)
    _eagle(model, head, _own_prompts(model, [5, 12, 9]))
    checked = 0
    for rows, finished, drafts in seen:
        for row, tokens in enumerate(rows):
            if finished[row]:
                continue
            features = target_features(model, tokens[None], head.config.feature_layers)
            with torch.no_grad():
                step0 = unrolled_hidden(model, head, features.hidden.float(), tokens[None], 1)[0]
            assert int(drafts[row]) == int(head.logits(model, step0[0, -1]).argmax()), (row, len(tokens))
            checked += 1
    assert checked > 10 and len(seen) > 3


def test_draft_length_varies_without_new_graphs():
    model = model_for("llama")
    head = trained_head(model)
    inputs = _own_prompts(model, [10])
    _eagle(model, head, inputs, min_draft_probability=0.0)  # warm-up: compiles the passes of every kind
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    stats = SpeculativeStats()
    for min_probability in (0.0, 0.2):
        out = _eagle(model, head, _own_prompts(model, [14]), eagle_stats=stats, num_draft_tokens=2,
                     max_draft_tokens=6, min_draft_probability=min_probability)
        assert torch.equal(out, _plain(model, _own_prompts(model, [14])))
    assert len(set(stats.draft_lengths)) > 1, stats.draft_lengths
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before


def test_frozen_head_graphs_follow_changes_to_the_head_and_the_target(monkeypatch):
    """On CPU the head's pass freezes the head's and the target's weights into its graph: after an in-place change
    to either, the compiled loop's head computes what it computes on a fresh copy of the changed modules (new
    graphs)."""
    model = copy.deepcopy(model_for("llama"))
    head = copy.deepcopy(trained_head(model_for("llama")))
    inputs = _own_prompts(model, [12])

    def outputs(target, eagle_head):
        """The head's hidden state at each round's start `[rounds, H]` and its drafts."""
        hidden, drafts, original = [], [], eagle_loop.HeadRounds.draft

        def recording(self, *args):
            hidden.append(self.last.hidden[0].clone())
            out = original(self, *args)
            drafts.append(out[0].tolist())
            return out

        with monkeypatch.context() as patch:
            patch.setattr(eagle_loop.HeadRounds, "draft", recording)
            # k fixed: the measured DraftLength picks k by timing, and the sides compared must run the same rounds
            patch.setattr(DraftLength, "next", lambda self, budget, batch_size=1: max(0, min(4, budget - 1)))
            _eagle(target, eagle_head, inputs, min_draft_probability=0.0)
        return torch.stack(hidden), drafts

    def same(a, b):
        return a[1] == b[1] and a[0].shape == b[0].shape and torch.allclose(a[0], b[0], atol=1e-5)

    before = outputs(model, head)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight  # the head reads its drafts out through the LM head
        weight.copy_(weight.roll(1, dims=0))
    changed = outputs(model, head)
    assert same(changed, outputs(copy.deepcopy(model), copy.deepcopy(head))) and not same(changed, before)
    with torch.no_grad():
        head.fc.weight[:, ::2].zero_()
    again = outputs(model, head)
    assert same(again, outputs(copy.deepcopy(model), copy.deepcopy(head))) and not same(again, changed)


def test_eos_pads_finished_rows_and_the_streamer_gets_every_token():
    model = model_for("llama")
    head = trained_head(model)
    inputs = _own_prompts(model, [9, 15, 5])
    free = _plain(model, inputs)
    eos = int(free[1, -10])  # a token row 1 emits mid-way: it stops there, later rows are padded
    assert torch.equal(_eagle(model, head, inputs, eos_token_id=eos), _plain(model, inputs, eos_token_id=eos))
    one = _own_prompts(model, [11])
    streamer = Collect()
    out = _eagle(model, head, one, streamer=streamer)
    assert streamer.ended and [t for chunk in streamer.chunks for t in chunk] == out[0].tolist()


@pytest.fixture(scope="module")
def sampling_model():
    return peaked_model_and_head()


def test_compiled_sampling_is_lossless(sampling_model):
    """Rows of one compiled call are independent samples: the 2nd-4th tokens' distribution matches plain sampling
    by the eager loop's chi-square test, and a wrong temperature fails it."""
    model, head = sampling_model
    torch.manual_seed(7)
    plain = model.generate(PROMPT.expand(NUM_PLAIN, -1), max_new_tokens=4, do_sample=True, top_k=0)

    def sampled(temperature):
        stats = SpeculativeStats()
        out = model.generate(PROMPT.expand(NUM_EAGLE, -1), max_new_tokens=4, do_sample=True, top_k=0,
                             temperature=temperature, custom_generate=eagle_generate, eagle_head=head,
                             num_draft_tokens=3, eagle_stats=stats, compile_config=COMPILE,
                             return_dict_in_generate=True)
        assert out.past_key_values is None  # the compiled loop ran
        return out.sequences, stats

    torch.manual_seed(1234)
    got, stats = sampled(1.0)
    assert stats.accepted[0] > 0 and 0 < stats.acceptance_rate < 1, stats  # drafts accepted and rejected
    check_columns(got, sampled(0.5)[0], plain, "compiled")


def test_processors_decode_eagerly_with_a_warning():
    model = model_for("llama")
    inputs = make_prompts([7], seed=1)
    with pytest.warns(UserWarning, match="eagle_generate"):
        out = _eagle(model, trained_head(model), inputs, repetition_penalty=1.3, return_dict_in_generate=True)
    assert out.past_key_values is not None  # the eager loop ran


def test_where_graphs_are_captured_the_verify_and_both_head_passes_replay_one_per_shape(monkeypatch):
    """With CUDA graphs asked for (a GPU, mode "reduce-overhead"), the target's verify and the head's two kinds of
    pass (a draft step, the catch-up over the verify's features) each go through one captured graph per shape."""
    RecordedGraph.install(monkeypatch, target_rounds, eagle_loop)
    model = model_for("llama")
    inputs = _own_prompts(model, [5, 12, 3])
    out = _eagle(model, trained_head(model), inputs, min_draft_probability=0.0,  # every round drafts k tokens
                 compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert torch.equal(out, _plain(model, inputs))
    shapes = RecordedGraph.assert_one_per_shape_and_replayed()
    assert any(shape[:2] == (3, 1) for shape in shapes), shapes  # a draft step: one entry per row
    assert len({step for step, _ in RecordedGraph.built}) == 3  # the verify, the draft step, the catch-up
