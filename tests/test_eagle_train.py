"""train_eagle on a tiny random model: the training-time-test mask is exact, the loss falls, a run resumed from a
checkpoint equals an uninterrupted one exactly, bad settings are refused, and `hf-accel train-eagle` writes a head
that loads and decodes."""

import json

import pytest
import torch
from conformance import PAD, make_model, make_tokenizer
from test_eagle_generate import own_text

from hf_accel import EagleHead, eagle_generate
from hf_accel.training.eagle_trainer import EagleTrainConfig, train_eagle
from hf_accel.training.eagle_unroll import unroll_mask

SETTINGS = dict(batch_size=8, seq_len=48, lr=3e-3, warmup_steps=2, unroll_steps=3, progress=False)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.float32, "sdpa")


def test_unroll_mask_is_causal_then_diagonal():
    allowed = unroll_mask(3, 2, torch.float32, torch.device("cpu"))[0, 0] == 0
    expected = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_loss_falls_and_later_steps_learn(model):
    result = train_eagle(model, own_text(model), steps=40, **SETTINGS)
    assert len(result.losses) == 40 and len(result.accuracies[0]) == 3
    assert sum(result.losses[-5:]) < 0.95 * sum(result.losses[:5]), result.losses
    first, last = result.accuracies[0], [sum(a[j] for a in result.accuracies[-5:]) / 5 for j in range(3)]
    assert all(b > a for a, b in zip(first, last)), (first, last)


def test_resume_equals_uninterrupted(model, tmp_path):
    rows = own_text(model)
    whole = train_eagle(model, rows, steps=6, output_dir=tmp_path, checkpoint_every=3, **SETTINGS)
    assert (tmp_path / "step-3" / "trainer_state.pt").is_file()
    resumed = train_eagle(model, rows, steps=6, resume_from=tmp_path / "step-3", **SETTINGS)
    assert resumed.first_step == 3 and resumed.last_step == 6
    assert resumed.losses == pytest.approx(whole.losses[3:], rel=1e-5)
    for a, b in zip(resumed.head.parameters(), whole.head.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("bad", [{"steps": 0}, {"unroll_steps": 0}, {"step_decay": 0.0}, {"dtype": "fp16"},
                                 {"seq_len": 3}, {"lr": 0.0}])
def test_bad_settings(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        EagleTrainConfig(**bad)


def test_train_eagle_command(model, tmp_path):
    datasets = pytest.importorskip("datasets")
    from hf_accel.training import eagle_command

    model.save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    datasets.Dataset.from_dict({"input_ids": own_text(model).tolist()}).save_to_disk(str(tmp_path / "data"))
    args = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data"), "--out", str(tmp_path / "head"),
            "--steps", "3", "--seq-len", "48", "--batch-size", "4", "--unroll-steps", "2", "--eval-prompts", "1",
            "--self-distill-rows", "8", "--corpus-rows", "8", "--no-progress"]
    assert eagle_command.main(args) == 0
    record = json.loads((tmp_path / "head" / "training.json").read_text())
    assert record["steps"] == 3 and record["held_out"]["tokens_per_target_forward"] >= 1.0
    head = EagleHead.from_pretrained(tmp_path / "head", model)
    assert head.fc.weight.dtype == torch.bfloat16
    prompt = own_text(model)[:1, :6]
    got = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD, custom_generate=eagle_generate,
                         eagle_head=head)
    assert torch.equal(got, model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD))
