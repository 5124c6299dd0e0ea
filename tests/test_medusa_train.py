"""train_medusa on a tiny random model: the loss falls, distillation modes run, a resumed run equals an uninterrupted
one exactly, datasets/lists/tensors are accepted, bad settings are refused; the trained heads speed up decoding of
the text they were trained on while output stays equal to plain greedy."""

import functools
import json

import pytest
import torch
from conformance import FIRST_WORD, PAD, VOCAB_SIZE, make_model, make_tokenizer

from hf_accel.speculative.medusa import medusa_generate
from hf_accel.speculative.stats import SpeculativeStats
from hf_accel.speculative.medusa_heads import MedusaHeads
from hf_accel.training.medusa_calibration import head_accuracy
from hf_accel.training.data import self_distilled_rows, token_rows
from hf_accel.training.medusa_trainer import MedusaTrainConfig, train_medusa

SETTINGS = dict(num_heads=2, batch_size=8, seq_len=48, lr=1e-2, warmup_steps=2, progress=False)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.float32, "sdpa")


@functools.lru_cache(maxsize=None)
def own_text(model) -> torch.Tensor:
    """`[32, 48]` rows of the model's own greedy continuations: learnable, and what greedy decoding produces."""
    prompts = torch.randint(FIRST_WORD, VOCAB_SIZE, (32, 3), generator=torch.Generator().manual_seed(0))
    return model.generate(prompts, max_new_tokens=45, do_sample=False, pad_token_id=PAD)


def test_loss_falls_and_heads_learn(model):
    rows = own_text(model)
    before = head_accuracy(model, MedusaHeads.for_model(model, num_heads=2), rows)
    result = train_medusa(model, rows, steps=40, **SETTINGS)
    assert result.last_step == 40 and len(result.losses) == 40
    assert sum(result.losses[-5:]) < 0.5 * sum(result.losses[:5])
    after = head_accuracy(model, result.heads, rows)
    assert all(a > b + 0.2 for a, b in zip(after, before)), (before, after)
    stats = SpeculativeStats()
    prompt = rows[:1, :6]
    # the whole tree every step: the adaptive default sizes trees by wall-clock step times, so on a loaded CPU it may
    # choose plain steps (seen once in a full run: 1.07 tokens per forward, where the whole tree gives 2.0-2.5)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=PAD, custom_generate=medusa_generate,
                         medusa_heads=result.heads, medusa_stats=stats, medusa_adaptive=False)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=PAD))
    assert stats.tokens_per_forward > 1.5, stats


def test_self_distilled_rows_are_greedy_continuations(model):
    rows = own_text(model)[:3]
    got = self_distilled_rows(model, rows, prompt_len=8, batch_size=2)
    assert got.shape == rows.shape
    for start in (0, 2):
        expected = model.generate(rows[start : start + 2, :8], max_new_tokens=40, do_sample=False, pad_token_id=PAD)
        assert torch.equal(got[start : start + 2], expected)


@pytest.mark.parametrize("distill", ["hard", "soft"])
def test_distillation_modes_train(model, distill):
    result = train_medusa(model, own_text(model), steps=4, distill=distill, dtype="bf16", **SETTINGS)
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))


def test_resume_equals_uninterrupted(model, tmp_path):
    rows = own_text(model)
    whole = train_medusa(model, rows, steps=6, **SETTINGS)
    train_medusa(model, rows, steps=3, output_dir=tmp_path, **SETTINGS)
    resumed = train_medusa(model, rows, steps=6, resume_from=tmp_path, **SETTINGS)
    assert resumed.first_step == 3 and resumed.last_step == 6
    assert resumed.losses == whole.losses[3:]
    for a, b in zip(resumed.heads.parameters(), whole.heads.parameters()):
        assert torch.equal(a, b)


def test_dataset_forms():
    datasets = pytest.importorskip("datasets")
    tokenizer = make_tokenizer()
    texts = ["abcdefgh" * 3, "xyz" * 5]
    from_text = token_rows(datasets.Dataset.from_dict({"text": texts}), 8, tokenizer)
    assert torch.equal(from_text, token_rows(texts, 8, tokenizer))
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert torch.equal(from_text, token_rows(datasets.Dataset.from_dict({"input_ids": ids}), 8, tokenizer))
    assert from_text.shape == (5, 8) and from_text[3, 0] == tokenizer.eos_token_id  # 24 tokens, then EOS
    assert token_rows(torch.arange(30).view(3, 10), 8).shape == (3, 8)
    with pytest.raises(ValueError, match="tokenizer"):
        token_rows(texts, 8)
    with pytest.raises(ValueError, match="dataset"):
        token_rows(datasets.Dataset.from_dict({"other": [1]}), 8)
    with pytest.raises(ValueError, match="dataset"):
        token_rows([], 8)


@pytest.mark.parametrize("bad", [{"num_heads": 0}, {"decay_factor": 0.0}, {"distill": "kl"}, {"dtype": "fp16"},
                                 {"seq_len": 3}, {"steps": 0}])
def test_bad_settings(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        MedusaTrainConfig(**bad)


def test_train_medusa_command(model, tmp_path):
    datasets = pytest.importorskip("datasets")
    from hf_accel.training import medusa_command

    model.save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    datasets.Dataset.from_dict({"input_ids": own_text(model).tolist()}).save_to_disk(str(tmp_path / "data"))
    args = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data"), "--out", str(tmp_path / "heads"),
            "--steps", "3", "--num-heads", "2", "--seq-len", "48", "--batch-size", "4", "--eval-rows", "2",
            "--self-distill-rows", "8", "--no-progress"]
    assert medusa_command.main(args) == 0
    record = json.loads((tmp_path / "heads" / "training.json").read_text())
    assert record["steps"] == 3 and set(record["held_out_top1_accuracy"]) == {"head_0", "head_1"}
    heads = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert heads.num_heads == 2 and heads.lm_heads[0].weight.dtype == torch.bfloat16
