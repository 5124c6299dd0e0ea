"""Sampling with compiled `ngram_generate` (`compile_config`) is lossless: the same chi-square test as the eager
loop's (tests/test_ngram_sampling.py: a 16-token vocabulary, repeating prompts, one left-padded batch whose rows
accept different numbers of tokens) passes against plain sampling and rejects a wrong temperature; the compiled loop
really ran (no fallback warning) and accepted some drafts; a processor the graph cannot apply falls back. Plain
compiled generate's in-graph draw passes the same test."""

import warnings

import pytest
import torch
from test_medusa_sampling import chi_square
from test_ngram_sampling import MASK, NEW, PLAIN_ROWS, PROMPTS, ROWS, _counts, _sample, model  # noqa: F401
from transformers import CompileConfig

from hf_accel import SpeculativeStats, ngram_generate

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
SEED = 99  # the eager test's seed puts the eager loop itself at the edge (37.7 against 37.8 at one token); the
# compiled loop draws the same random stream, so a seed of its own keeps the test about the rule, not that draw


def _sample_compiled(model, rows: int, temperature: float, **kwargs) -> torch.Tensor:  # noqa: F811
    torch.manual_seed(SEED)
    return model.generate(input_ids=PROMPTS.repeat(rows // 2, 1), attention_mask=MASK.repeat(rows // 2, 1),
                          max_new_tokens=NEW, do_sample=True, top_k=0, temperature=temperature, pad_token_id=0,
                          custom_generate=ngram_generate, draft_token_cost=0.0, compile_config=COMPILE, **kwargs)


def test_compiled_sampled_tokens_follow_plain_sampling(model):  # noqa: F811
    plain = _sample(model, PLAIN_ROWS, 1.0)
    stats = SpeculativeStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to the eager loop would warn
        compiled = _sample_compiled(model, ROWS, 1.0, ngram_stats=stats)
    wrong = _sample_compiled(model, ROWS, 0.6)
    assert 0.1 < stats.acceptance_rate < 0.9 and stats.tokens_per_forward > 1.2, stats  # drafts partly accepted
    for prompt in (0, 1):
        for column in range(1, NEW):
            reference = _counts(plain, prompt, column)
            statistic, critical = chi_square(_counts(compiled, prompt, column), reference)
            where = f"prompt {prompt}, token {column}"
            assert statistic < critical, f"{where}: chi-square {statistic:.1f} >= {critical:.1f}"
            statistic, critical = chi_square(_counts(wrong, prompt, column), reference)
            assert statistic > critical, f"{where}: a wrong temperature passed ({statistic:.1f})"


def test_a_processor_outside_the_graph_falls_back_with_a_warning(model):  # noqa: F811
    with pytest.warns(UserWarning, match="compile_config is not applied to ngram_generate"):
        out = _sample(model, 4, 1.0, custom_generate=ngram_generate, compile_config=COMPILE, repetition_penalty=1.2)
    assert out.shape == (4, PROMPTS.shape[1] + NEW) and MASK.shape[0] == 2


def test_compiled_plain_sampling_follows_plain_sampling(model):  # noqa: F811
    # compiled generate draws inside its graph (the exponential race over transformers' warped probabilities)
    plain = _sample(model, PLAIN_ROWS, 1.0)
    torch.manual_seed(SEED)
    compiled = model.generate(input_ids=PROMPTS.repeat(ROWS // 2, 1), attention_mask=MASK.repeat(ROWS // 2, 1),
                              max_new_tokens=NEW, do_sample=True, top_k=0, temperature=1.0, pad_token_id=0,
                              cache_implementation="paged", compile_config=COMPILE)
    for prompt in (0, 1):
        for column in range(1, NEW):
            statistic, critical = chi_square(_counts(compiled, prompt, column), _counts(plain, prompt, column))
            assert statistic < critical, f"prompt {prompt}, token {column}: chi-square {statistic:.1f}"
