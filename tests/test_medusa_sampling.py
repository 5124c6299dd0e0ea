"""Sampling with Medusa is lossless: on a tiny model with a 16-token vocabulary, the distribution of the 2nd, 3rd
and 4th sampled tokens (decided at the root and at tree nodes of depth 1 and 2) matches plain sampling by a
chi-square test at alpha 0.001, and the same test rejects a wrong temperature (so its tolerance can fail). At batch
size 4 (two prompts, one left-padded, each twice) every row's distribution matches plain sampling of its prompt."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel.speculative.medusa import medusa_generate
from hf_accel.speculative.stats import SpeculativeStats
from hf_accel.speculative.medusa_heads import MedusaHeads

VOCAB = 16
TREE = [(i,) for i in range(VOCAB)] + [(i, j) for i in range(VOCAB) for j in range(8)]
PROMPT = torch.tensor([[3, 7, 1, 12]])
SHORT = {"input_ids": torch.tensor([[0, 0, 9, 5]]), "attention_mask": torch.tensor([[0, 0, 1, 1]])}  # left-padded
NUM_MEDUSA, NUM_PLAIN = 200, 20000


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(40)  # peaked, position-dependent distributions rather than near-uniform ones
        heads = MedusaHeads.for_model(model, num_heads=2)
    model.generation_config.eos_token_id = None
    return model, heads


def token_counts(sequences: torch.Tensor, column: int) -> torch.Tensor:
    return torch.bincount(sequences[:, PROMPT.shape[1] + column], minlength=VOCAB).double()


def chi_square(observed: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Statistic of `observed` counts against the `reference` frequencies (cells expected < 5 pooled) and its
    critical value at alpha 0.001 (Wilson-Hilferty approximation of the chi-square quantile)."""
    expected = reference / reference.sum() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    statistic = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.090  # standard normal quantile at 0.999
    return statistic, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def medusa_samples(model, heads, temperature: float) -> tuple[torch.Tensor, SpeculativeStats]:
    torch.manual_seed(1234)
    stats = SpeculativeStats()
    rows = [model.generate(PROMPT, max_new_tokens=4, do_sample=True, top_k=0, temperature=temperature,
                           custom_generate=medusa_generate, medusa_heads=heads, medusa_tree=TREE, medusa_stats=stats)
            for _ in range(NUM_MEDUSA)]
    return torch.cat(rows), stats


def test_sampling_distribution_matches_plain(model):
    model, heads = model
    torch.manual_seed(99)
    plain = model.generate(PROMPT.expand(NUM_PLAIN, -1), max_new_tokens=4, do_sample=True, top_k=0)
    samples, stats = medusa_samples(model, heads, temperature=1.0)
    assert stats.accepted[0] >= NUM_MEDUSA and stats.accepted[1] > 0, stats  # tree path used
    wrong, _ = medusa_samples(model, heads, temperature=0.5)
    for column in (1, 2, 3):
        statistic, critical = chi_square(token_counts(samples, column), token_counts(plain, column))
        assert statistic < critical, f"token {column}: chi-square {statistic:.1f} >= {critical:.1f}"
        statistic, critical = chi_square(token_counts(wrong, column), token_counts(plain, column))
        assert statistic > critical, f"token {column}: the test did not reject a wrong temperature ({statistic:.1f})"


def batch_samples(model, heads, temperature: float, calls: int) -> tuple[list[torch.Tensor], SpeculativeStats]:
    """Rows [PROMPT, SHORT, PROMPT, SHORT] sampled together `calls` times -> samples of PROMPT, samples of SHORT."""
    torch.manual_seed(4321)
    stats = SpeculativeStats()
    ids = torch.cat([PROMPT, SHORT["input_ids"]] * 2)
    mask = torch.cat([torch.ones_like(PROMPT), SHORT["attention_mask"]] * 2)
    out = torch.cat([model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=0,
                                    temperature=temperature, custom_generate=medusa_generate, medusa_heads=heads,
                                    medusa_tree=TREE, medusa_stats=stats) for _ in range(calls)])
    return [out[0::2], out[1::2]], stats


def test_sampling_distribution_matches_plain_per_row_at_batch_4(model):
    model, heads = model
    torch.manual_seed(98)
    plain = [model.generate(PROMPT.expand(NUM_PLAIN, -1), max_new_tokens=4, do_sample=True, top_k=0),
             model.generate(**{k: v.expand(NUM_PLAIN, -1) for k, v in SHORT.items()}, max_new_tokens=4,
                            do_sample=True, top_k=0)]
    samples, stats = batch_samples(model, heads, temperature=1.0, calls=NUM_MEDUSA // 2)
    assert stats.accepted[0] >= stats.num_row_rounds // 2 and stats.accepted[1] > 0, stats
    wrong, _ = batch_samples(model, heads, temperature=0.5, calls=NUM_MEDUSA // 2)
    for prompt, (got, bad, reference) in enumerate(zip(samples, wrong, plain)):
        for column in (1, 2, 3):
            statistic, critical = chi_square(token_counts(got, column), token_counts(reference, column))
            assert statistic < critical, f"prompt {prompt} token {column}: chi-square {statistic:.1f} >= {critical:.1f}"
            statistic, critical = chi_square(token_counts(bad, column), token_counts(reference, column))
            assert statistic > critical, f"prompt {prompt} token {column}: a wrong temperature passed ({statistic:.1f})"
