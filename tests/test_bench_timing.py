"""hf_accel.bench.timing: a (1 token, N tokens) pair whose difference a load spike made non-positive is measured
again, so a noisy machine does not turn a decode time negative."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel.bench import timing
from hf_accel.bench.strategies import STRATEGIES, Strategy


@pytest.fixture
def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def spiked_one_token_runs(monkeypatch, spikes: int) -> list[int]:
    """Make the first `spikes` one-token runs report 10 s (a load spike); returns the new-token count of every run."""
    real, calls = timing.run_generate, []

    def run_generate(model, inputs, strategy, new_tokens, **kwargs):
        calls.append(new_tokens)
        seconds, output = real(model, inputs, strategy, new_tokens, **kwargs)
        return (10.0 if new_tokens == 1 and calls.count(1) <= spikes else seconds), output

    monkeypatch.setattr(timing, "run_generate", run_generate)
    return calls


def test_a_spiked_pair_is_measured_again(tiny_llama, monkeypatch):
    calls = spiked_one_token_runs(monkeypatch, spikes=1)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    [result] = timing.compare_strategies(tiny_llama, inputs, 4, STRATEGIES[:1], repeats=1, warmup=0, progress=False)
    assert calls == [1, 4, 1, 4]  # the spiked pair, then its re-measure
    assert result.decode_tokens_per_s > 0 and all(s > 0 for s in result.decode_seconds)


def test_a_machine_too_noisy_for_every_attempt_is_reported(tiny_llama, monkeypatch):
    calls = spiked_one_token_runs(monkeypatch, spikes=timing.PAIR_ATTEMPTS)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    with pytest.raises(RuntimeError, match="too noisy"):
        timing.compare_strategies(tiny_llama, inputs, 4, STRATEGIES[:1], repeats=1, warmup=0, progress=False)
    assert calls == [1, 4] * timing.PAIR_ATTEMPTS


def test_a_row_that_fails_is_left_out_with_its_reason(tiny_llama):
    def broken(model, inputs, new_tokens):
        raise ValueError("this model has no such thing")

    def broken_variant(model):
        raise TypeError("cannot quantize this model")

    rows = (STRATEGIES[0], Strategy("broken run", "", run=broken),
            Strategy("broken variant", "", model_variant=broken_variant))
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    errors = []
    results = timing.compare_strategies(tiny_llama, inputs, 4, rows, repeats=1, warmup=1, progress=False,
                                        on_error=lambda name, error: errors.append((name, str(error))))
    assert [r.name for r in results] == [STRATEGIES[0].name]
    # in the order the rows first run (a variant is built at its row's first run)
    assert errors == [("broken run", "this model has no such thing"), ("broken variant", "cannot quantize this model")]
    with pytest.raises(ValueError, match="no such thing"):  # without on_error the error is the caller's
        timing.compare_strategies(tiny_llama, inputs, 4, rows[:2], repeats=1, warmup=0, progress=False)
