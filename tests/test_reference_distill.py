"""Distilling a reference model from a teacher: the loss is KL to the teacher's next-token distribution, and training
on it brings the student's greedy choices to the teacher's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_accel.reference import corpus
from hf_accel.reference.evaluate import greedy_agreement
from hf_accel.training.reference_presets import MODEL_PRESETS, TRAIN_RECIPES
from hf_accel.training.reference_tokenizer import train_tokenizer
from hf_accel.training.reference_trainer import build_model, distillation_loss, train_model
from tiny_corpus import packed_rows, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def rows(tokenizer) -> torch.Tensor:
    return packed_rows(tokenizer, 6)


def test_distillation_loss_is_kl_to_the_teacher():
    teacher = torch.randn(2, 3, 11)
    assert distillation_loss(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    student = torch.randn(2, 3, 11)
    p, log_p, log_q = teacher.softmax(-1), teacher.log_softmax(-1), student.log_softmax(-1)
    expected = (p * (log_p - log_q)).sum(-1).mean()
    assert distillation_loss(student, teacher).item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_distilled_student_follows_its_teacher(tokenizer, rows):
    teacher = build_model(MODEL_PRESETS["tiny"], tokenizer, seed=0)
    train_model(teacher, rows, dataclasses.replace(TRAIN_RECIPES["tiny"], steps=40), progress=False)
    teacher.eval()
    student = build_model(dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=1), tokenizer, seed=1)
    eval_rows = rows[:8]

    def kl() -> float:
        with torch.no_grad():
            return distillation_loss(student(eval_rows).logits, teacher(eval_rows).logits).item()

    kl_before, agreement_before = kl(), greedy_agreement(student, teacher, eval_rows)
    result = train_model(student, rows, dataclasses.replace(TRAIN_RECIPES["tiny"], steps=40), progress=False,
                         teacher=teacher)
    assert result.losses[-1] < result.losses[0]
    assert kl() < 0.5 * kl_before
    assert greedy_agreement(student, teacher, eval_rows) > agreement_before + 0.2
    assert all(p.grad is None for p in teacher.parameters())  # the teacher stays frozen


def test_teacher_must_share_the_vocabulary(tokenizer, rows):
    student = build_model(MODEL_PRESETS["tiny"], tokenizer, seed=0)
    teacher = build_model(MODEL_PRESETS["tiny"], train_tokenizer(corpus.load_split("train").texts[:20], 300), seed=0)
    with pytest.raises(ValueError, match="teacher's vocab_size 300 must equal the model's 512"):
        train_model(student, rows, TRAIN_RECIPES["tiny"], progress=False, teacher=teacher)
