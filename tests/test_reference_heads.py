"""The reference target's committed speculative heads: `reference.load_head` loads both kinds, refuses other names
and names the training command when heads are missing; the EAGLE head is small, decodes held-out code exactly as
plain greedy `generate` does (batch 1 and a left-padded batch of 3) and accepts more than two tokens per target
forward."""

from __future__ import annotations

import pytest
import torch

from hf_accel import EagleHead, MedusaHeads, SpeculativeStats, eagle_generate, reference

EAGLE_DIR = reference.ASSETS_DIR / "eagle"
MIN_TOKENS_PER_FORWARD = 2.0  # measured 2.52 on these 3 prompts (plain decoding: 1.0; an untrained head: about 1.0)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return reference.load("target")


def test_load_head_kinds_and_errors(target, tmp_path):
    model, _ = target
    assert isinstance(reference.load_head("medusa"), MedusaHeads)
    head = reference.load_head("eagle", model)
    assert isinstance(head, EagleHead) and head.fc.weight.dtype == torch.float32
    assert head.config.feature_layers == (2, 4, 5)
    with pytest.raises(ValueError, match="eagle"):
        reference.load_head("hydra")
    with pytest.raises(FileNotFoundError, match="hf-accel train-eagle"):
        reference.load_head("eagle", model, assets_dir=tmp_path)


def test_eagle_assets_are_small():
    sizes = {path.name: path.stat().st_size for path in EAGLE_DIR.iterdir()}
    assert set(sizes) == {"eagle_config.json", "eagle_head.safetensors", "training.json"}
    assert sum(sizes.values()) < 4 * 2**20, sizes


def test_eagle_on_held_out_code_equals_plain_greedy_and_accepts(target):
    model, tokenizer = target
    head = reference.load_head("eagle", model)
    rows = reference.held_out_sequences(tokenizer, seq_len=48, max_rows=4)[1:]
    stats = SpeculativeStats()
    options = dict(max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
    for row in rows:
        got = model.generate(row[None], custom_generate=eagle_generate, eagle_head=head, eagle_stats=stats, **options)
        assert torch.equal(got, model.generate(row[None], **options))
    # per speculating forward: `DraftLength` may decode some rounds plainly (it times them while speculation is in
    # question), which says nothing about the head
    assert 1 + sum(stats.accepted) / stats.proposed[0] > MIN_TOKENS_PER_FORWARD, stats
    ids = torch.stack([torch.cat([torch.zeros(16 * i, dtype=torch.long), row[16 * i :]]) for i, row in enumerate(rows)])
    inputs = {"input_ids": ids, "attention_mask": (torch.arange(48) >= 16 * torch.arange(3)[:, None]).long()}
    got = model.generate(**inputs, custom_generate=eagle_generate, eagle_head=head, **options)
    assert torch.equal(got, model.generate(**inputs, **options))
