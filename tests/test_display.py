"""Rich displays: one-line repr and Jupyter HTML tables from the same `summary()`, on caches, heads and stats."""

import pytest
import torch

import hf_accel
from hf_accel.display import Table, format_bytes, html_table, one_line
from tiny_llama import tiny_llama


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (200 * 1024, "200 KiB"), (3 * 2**30, "3.0 GiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_one_line_and_html_table_show_the_same_fields():
    fields = {"rate": 0.123456, "by_position": [1.0, 0.5], "name": "<b>&"}
    assert one_line("Thing", fields) == "Thing(rate=0.123, by_position=[1 0.5], name=<b>&)"
    table = html_table("Thing", fields)
    assert table.count("<tr>") == 3 and "&lt;b&gt;&amp;" in table and "<b>Thing</b>" in table
    assert "<td style='padding:1px 8px;text-align:left'>[1 0.5]</td>" in table


@pytest.mark.parametrize("implementation, config, expected", [
    ("paged", {"block_size": 4}, "PagedCache(block_size=4, layers=2, tokens=14, memory={}, blocks_used=4/4)"),
    ("quantized", {"backend": "hf_accel", "nbits": 4, "group_size": 16, "residual_length": 16},
     "QuantizedKVCache(nbits=4, group_size=16, residual_length=16, num_fp_sink_tokens=4, layers=2, tokens=14, "
     "memory={})"),
    ("sink", {"window_length": 8, "num_sink_tokens": 2},
     "SinkCache(window_length=8, num_sink_tokens=2, layers=2, tokens=14, memory={})"),
])
def test_cache_repr_after_generate(implementation, config, expected):
    model = tiny_llama()
    prompt = torch.randint(1, 128, (1, 10))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation=implementation,
                         cache_config=config, return_dict_in_generate=True)
    cache = out.past_key_values  # 10 prompt tokens + 4 fed back (the 5th new token is never fed)
    assert repr(cache) == expected.format(format_bytes(cache.memory_bytes()))
    assert "<caption><b>" + type(cache).__name__ in cache._repr_html_()


def test_empty_paged_cache_repr():
    cache = hf_accel.PagedCache(tiny_llama().config, block_size=8)
    assert repr(cache) == "PagedCache(block_size=8, layers=2, tokens=0, memory=0 B, blocks_used=0/0)"


def test_speculative_stats_display():
    stats = hf_accel.SpeculativeStats(num_target_forwards=4, num_draft_forwards=12, num_emitted=10,
                                      num_row_rounds=4, proposed=[4, 3], accepted=[3, 1])
    assert repr(stats) == ("SpeculativeStats(target_forwards=4, draft_forwards=12, tokens_emitted=10, "
                           "tokens_per_forward=2.5, acceptance_rate=0.571, acceptance_by_position=[0.75 0.333])")
    assert stats._repr_html_().count("<tr>") == 6


def test_medusa_stats_display():
    """Medusa fills the one `SpeculativeStats` record: one row, 9 new tokens, the prefill's first then 8 from 4 tree
    forwards, so 2.0 tokens per forward (the prefill is not counted)."""
    stats = hf_accel.SpeculativeStats(num_target_forwards=4, num_draft_forwards=4, num_emitted=8, num_row_rounds=4,
                                      num_new_tokens=9, proposed=[4, 2], accepted=[2, 1], draft_lengths=[5, 5, 3, 3])
    assert stats.acceptance_by_position == [0.5, 0.5]
    assert repr(stats) == ("SpeculativeStats(target_forwards=4, draft_forwards=4, tokens_emitted=8, "
                           "tokens_per_forward=2, acceptance_rate=0.5, acceptance_by_position=[0.5 0.5])")


def test_medusa_stats_is_a_deprecated_name_for_speculative_stats():
    """`hf_accel.MedusaStats` left the public API; for one release it still imports, warning with the new name."""
    assert "MedusaStats" not in hf_accel.__all__
    with pytest.warns(DeprecationWarning, match="hf_accel.MedusaStats.*hf_accel.SpeculativeStats"):
        assert hf_accel.MedusaStats is hf_accel.SpeculativeStats
    with pytest.raises(AttributeError, match="NoSuchName"):
        hf_accel.NoSuchName  # noqa: B018


def test_medusa_heads_display():
    model = tiny_llama()
    heads = hf_accel.MedusaHeads.for_model(model, num_heads=3)
    parameters = sum(p.numel() for p in heads.parameters())
    assert repr(heads) == (f"MedusaHeads(num_heads=3, num_layers=1, hidden_size=64, vocab_size=128, "
                           f"parameters={parameters}, tree_paths=default, base_model=None)")
    assert "<th style='padding:1px 8px;text-align:left'>num_heads</th>" in heads._repr_html_()


def test_table_text_and_html():
    table = Table("decode", ["cache", "tokens/s"], [["DynamicCache", 2100.4], ["paged", 5.0]])
    assert str(table) == "decode\ncache         tokens/s\nDynamicCache  2100\npaged         5"
    assert table._repr_html_().count("<tr>") == 3 and "<th style='padding:1px 8px;text-align:left'>cache</th>" in \
        table._repr_html_()
    with pytest.raises(ValueError, match="every row of `rows` must have 2 values"):
        Table("bad", ["a", "b"], [[1]])
