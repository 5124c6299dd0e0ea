"""Sampling with `draft_generate` is lossless: on a tiny model with a 12-token vocabulary, the tokens it samples at
positions 2-5 follow the target's distribution (given each row's own earlier tokens) as closely as plain sampling's
do, in a left-padded batch whose rows accept different numbers of drafts; eagerly and compiled (`compile_config`)."""

import pytest
import torch
import transformers
from transformers import CompileConfig
from conformance import make_draft_model

import hf_accel

VOCAB, NEW, ROWS, TEMPERATURE = 12, 5, 4000, 0.8
TOLERANCE = 0.05  # total variation; sampling noise at 4000 rows is ~0.02, the draft's own distribution is >= 0.1 off


@pytest.fixture(scope="module")
def pair():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                      bos_token_id=None, eos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked distributions: a handful of likely tokens per position
    model.generation_config.eos_token_id = None
    return model, make_draft_model(model, noise=0.5)


def _prompts():
    # rows alternate between a 6-token prompt and a left-padded 3-token one
    ids = torch.tensor([[3, 5, 7, 2, 9, 4], [0, 0, 0, 8, 1, 6]]).repeat(ROWS // 2, 1)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def _target_distributions(model, sequences, mask):
    """`[rows, NEW, vocab]`: the target's (temperature-scaled) distribution of each generated token given the row's
    tokens before it."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, mask.shape[1] :])], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask, position_ids=positions).logits.float()
    start = mask.shape[1] - 1
    return torch.softmax(logits[:, start : start + NEW] / TEMPERATURE, dim=-1)


def _total_variation(sequences, distributions, position, prompt_width):
    observed = torch.bincount(sequences[:, prompt_width + position], minlength=VOCAB).double() / ROWS
    return 0.5 * (observed - distributions[:, position].double().mean(0)).abs().sum().item()


def test_sampled_tokens_follow_the_target_distribution(pair):
    model, draft = pair
    inputs = _prompts()
    width = inputs["input_ids"].shape[1]
    stats = {"draft": hf_accel.SpeculativeStats(), "draft + compile": hf_accel.SpeculativeStats()}
    results = {}
    for name, kwargs in (("plain", {}),
                         ("draft", {"custom_generate": hf_accel.draft_generate, "draft_model": draft,
                                    "draft_stats": stats["draft"]}),
                         ("draft + compile", {"custom_generate": hf_accel.draft_generate, "draft_model": draft,
                                              "draft_stats": stats["draft + compile"],
                                              "compile_config": CompileConfig(fullgraph=True)})):
        torch.manual_seed(0)
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE, top_k=0,
                             pad_token_id=0, return_dict_in_generate=True, **kwargs)
        assert (out.past_key_values is None) == (name == "draft + compile")  # which loop ran
        out = out.sequences
        assert out.shape == (ROWS, width + NEW)
        target = _target_distributions(model, out, inputs["attention_mask"])
        as_draft = _target_distributions(draft, out, inputs["attention_mask"])
        results[name] = [(_total_variation(out, target, s, width), _total_variation(out, as_draft, s, width))
                         for s in range(1, NEW)]
    for counted in stats.values():  # drafts partly accepted
        per_drafting_forward = 1 + sum(counted.accepted) / counted.proposed[0]  # rounds decoded plainly left out
        assert 0.2 < counted.acceptance_rate < 0.9 and per_drafting_forward > 1.2, counted
    for name, per_position in results.items():
        for position, (to_target, to_draft) in enumerate(per_position, start=1):
            assert to_target < TOLERANCE, f"{name}: token {position} is {to_target:.3f} from the target's law"
            assert to_draft > 2 * TOLERANCE, f"{name}: token {position} cannot tell target from draft"
