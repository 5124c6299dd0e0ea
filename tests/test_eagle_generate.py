"""eagle_generate against plain generate on tiny random models: greedy token for token at batch 1 and in left-padded
ragged batches, with DynamicCache and the paged cache; a head trained a few steps on the model's own text drafts
tokens that are accepted; each round's first draft equals the head's prediction computed without a cache over the
row's compact tokens (the head's cache layout with holes is exact); save/load; bad input. Sampling:
test_eagle_sampling.py."""

import functools

import pytest
import torch
from conformance import FIRST_WORD, PAD, VOCAB_SIZE, make_model, make_prompts
from tiny_llama import tiny_llama
from transformers import DynamicCache

import hf_accel
from hf_accel import EagleConfig, EagleHead, SpeculativeStats, eagle_generate
from hf_accel.training.eagle_features import target_features
from hf_accel.training.eagle_trainer import train_eagle
from hf_accel.training.eagle_unroll import unrolled_hidden
from hf_accel.speculative.eagle_draft import HeadState

NEW = 24


@functools.lru_cache(maxsize=None)
def model_for(arch: str):
    return make_model(arch, torch.float32, "sdpa")


@functools.lru_cache(maxsize=None)
def own_text(model) -> torch.Tensor:
    """`[32, 48]` rows of the model's own greedy continuations of 3-token prompts."""
    prompts = torch.randint(FIRST_WORD, VOCAB_SIZE, (32, 3), generator=torch.Generator().manual_seed(0))
    return model.generate(prompts, max_new_tokens=45, do_sample=False, pad_token_id=PAD)


@functools.lru_cache(maxsize=None)
def trained_head(model) -> EagleHead:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        result = train_eagle(model, own_text(model), steps=60, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=2,
                             unroll_steps=3, progress=False)
    return result.head


def run(model, inputs, eagle=True, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **kwargs}
    if eagle:
        kwargs |= {"custom_generate": eagle_generate, "eagle_head": trained_head(model)}
    return model.generate(**inputs, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("cache_implementation", ["dynamic", "paged"])
@pytest.mark.parametrize("lengths", [[9], [5, 12, 3]])
def test_greedy_equals_plain(arch, cache_implementation, lengths):
    model = model_for(arch)
    inputs = make_prompts(lengths, seed=len(lengths))
    stats = SpeculativeStats()
    got = run(model, inputs, cache_implementation=cache_implementation, eagle_stats=stats,
              return_dict_in_generate=True)
    expected = hf_accel.PagedCache if cache_implementation == "paged" else DynamicCache
    assert type(got.past_key_values) is expected
    assert torch.equal(got.sequences, run(model, inputs, eagle=False, cache_implementation=cache_implementation))
    assert stats.num_new_tokens == NEW * len(lengths)
    assert stats.num_draft_forwards > 0 and sum(stats.proposed) > 0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("min_probability", [0.0, 0.2])
def test_trained_head_drafts_accepted_tokens(batch, min_probability):
    model = model_for("llama")
    prompts = own_text(model)[:batch, :8]  # the text the head was trained on: it drafts it well
    stats = SpeculativeStats()
    got = model.generate(prompts, max_new_tokens=32, do_sample=False, pad_token_id=PAD,
                         custom_generate=eagle_generate, eagle_head=trained_head(model), eagle_stats=stats,
                         min_draft_probability=min_probability)
    assert torch.equal(got, model.generate(prompts, max_new_tokens=32, do_sample=False, pad_token_id=PAD))
    assert stats.accepted[0] > 0 and stats.tokens_per_forward > 1.1, stats
    assert stats.num_target_forwards < 31 * batch
    if min_probability == 0.0:  # every round drafts the whole k
        assert stats.num_draft_forwards == sum(stats.draft_lengths)


def test_first_drafts_equal_uncached_head(monkeypatch):
    """Rows of different lengths accept different numbers of drafts (holes in the layout); at every round the
    head's first draft must equal its step-0 prediction over the row's compact tokens, computed from scratch."""
    model = model_for("llama")
    head = trained_head(model)
    seen = []
    original = HeadState.catch_up

    def recording(state, model_, batch):
        hidden = original(state, model_, batch)
        seen.append((batch.tokens.clone(), batch.history_lengths.clone(), batch.unfinished.clone(),
                     head.logits(model_, hidden).argmax(-1)))
        return hidden

    monkeypatch.setattr(HeadState, "catch_up", recording)
    inputs = make_prompts([5, 12, 9], seed=7)
    run(model, inputs)
    pads = (1 - inputs["attention_mask"]).sum(1)
    checked = 0
    for tokens, lengths, unfinished, drafts in seen:
        for row in unfinished.nonzero().squeeze(1).tolist():
            compact = tokens[row, int(pads[row]) : int(lengths[row])][None]  # the row without its padding
            features = target_features(model, compact, head.config.feature_layers)
            with torch.no_grad():
                step0 = unrolled_hidden(model, head, features.hidden.float(), compact, 1)[0]
            assert int(drafts[row]) == int(head.logits(model, step0[0, -1]).argmax()), (row, int(lengths[row]))
            checked += 1
    assert checked > 10 and len(seen) > 3


def test_save_and_load(tmp_path):
    model = model_for("llama")
    head = trained_head(model)
    head.save_pretrained(tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path, model)
    for name in ("hidden_size", "vocab_size", "num_target_layers", "feature_layers"):
        assert getattr(loaded.config, name) == getattr(head.config, name), name
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    inputs = make_prompts([7], seed=2)
    assert torch.equal(run(model, inputs), model.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                       pad_token_id=PAD, custom_generate=eagle_generate, eagle_head=loaded))


def test_bad_input():
    model = model_for("llama")
    inputs = make_prompts([6], seed=1)
    with pytest.raises(TypeError, match="eagle_head"):
        model.generate(**inputs, max_new_tokens=4, custom_generate=eagle_generate)
    with pytest.raises(ValueError, match="eagle_head"):
        model.generate(**inputs, max_new_tokens=4, custom_generate=eagle_generate,
                       eagle_head=EagleHead.for_model(tiny_llama(num_hidden_layers=3)))
    with pytest.raises(ValueError, match="beam"):
        run(model, inputs, num_beams=2)
    for bad in (1.0, -0.1, "0.5"):
        with pytest.raises(ValueError, match="min_draft_probability"):
            run(model, inputs, min_draft_probability=bad)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        run(model, inputs, num_draft_tokens=0)
    with pytest.raises(ValueError, match="feature_layers"):
        EagleConfig(hidden_size=64, vocab_size=160, num_target_layers=2, feature_layers=(1, 2, 5), layer_config={})
