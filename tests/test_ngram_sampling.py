"""Sampling with `ngram_generate` is lossless: on a tiny model with a 16-token vocabulary and repeating prompts (so
prompt lookup drafts, and some drafts are accepted), the 2nd to 5th sampled tokens of each prompt follow plain
sampling's distribution by a chi-square test at alpha 0.001, in one left-padded batch whose rows accept different
numbers of tokens; the same test rejects a wrong temperature (so its tolerance can fail)."""

import pytest
import torch
from test_medusa_sampling import chi_square
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel import SpeculativeStats, ngram_generate

VOCAB, NEW, ROWS, PLAIN_ROWS = 16, 5, 3000, 20000
# cycles of the model's own greedy text (so its samples often continue them); the second prompt is left-padded
PROMPTS = torch.tensor([[9, 5, 1, 14, 13, 0, 1, 14, 13, 0, 1, 14], [0, 0, 0, 6, 8, 14, 13, 0, 3, 8, 14, 13]])
MASK = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9])


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(30)  # peaked, position-dependent distributions rather than near-uniform ones
    model.generation_config.eos_token_id = None
    return model


def _sample(model, rows: int, temperature: float, **kwargs) -> torch.Tensor:
    torch.manual_seed(1234)
    return model.generate(input_ids=PROMPTS.repeat(rows // 2, 1), attention_mask=MASK.repeat(rows // 2, 1),
                          max_new_tokens=NEW, do_sample=True,
                          top_k=0, temperature=temperature, pad_token_id=0, **kwargs)


def _counts(sequences: torch.Tensor, prompt: int, column: int) -> torch.Tensor:
    return torch.bincount(sequences[prompt::2, PROMPTS.shape[1] + column], minlength=VOCAB).double()


def test_sampled_tokens_follow_plain_sampling(model):
    plain = _sample(model, PLAIN_ROWS, 1.0)
    stats = SpeculativeStats()
    ngram = _sample(model, ROWS, 1.0, custom_generate=ngram_generate, ngram_stats=stats, draft_token_cost=0.0)
    wrong = _sample(model, ROWS, 0.6, custom_generate=ngram_generate, draft_token_cost=0.0)
    assert 0.1 < stats.acceptance_rate < 0.9 and stats.tokens_per_forward > 1.2, stats  # drafts partly accepted
    for prompt in (0, 1):
        for column in range(1, NEW):
            reference = _counts(plain, prompt, column)
            statistic, critical = chi_square(_counts(ngram, prompt, column), reference)
            where = f"prompt {prompt}, token {column}"
            assert statistic < critical, f"{where}: chi-square {statistic:.1f} >= {critical:.1f}"
            statistic, critical = chi_square(_counts(wrong, prompt, column), reference)
            assert statistic > critical, f"{where}: a wrong temperature passed ({statistic:.1f})"
