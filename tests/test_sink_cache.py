"""SinkCache bookkeeping, exact on tiny numbers: which column every returned slot holds, crop, beam reorder, memory.

Values are never rotated, so feeding value states that encode their own column (`100 * row + column + 1`) makes the
returned values spell out, slot by slot, which column the cache presents there.
"""

import pytest
import torch
import transformers

import hf_accel
from conformance import _COMMON, make_prompts

CONFIG = transformers.LlamaConfig(**_COMMON)  # 2 layers, 2 KV heads, head_dim 16


def column_states(rows: int, first: int, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (random) and values (`100 * row + column + 1` everywhere), `[rows, 2, num, 16]` for columns
    first .. first + num - 1."""
    columns = torch.arange(first, first + num, dtype=torch.float32)
    values = (100 * torch.arange(rows)[:, None] + columns[None] + 1)[:, None, :, None].expand(rows, 2, num, 16)
    return torch.randn(rows, 2, num, 16), values.contiguous()


def feed(cache: hf_accel.SinkCache, first: int, num: int, rows: int) -> list[list[int]]:
    """One step of `num` tokens through both layers; the columns (-1 for a stored sink) each row is shown."""
    keys, values = column_states(rows, first, num)
    kv_length, kv_offset = cache.get_mask_sizes(num, 0)
    for layer in range(2):
        out_keys, out_values = cache.update(keys, values, layer)
    assert out_values.shape[2] == kv_length and cache.get_seq_length() == first + num
    shown = out_values[:, 0, :, 0].long() - 1 - 100 * torch.arange(rows)[:, None]
    return [[c if c >= kv_offset or c < 0 else -1000 - c for c in row] for row in shown.tolist()]


def expected_columns(seen: int, num_new: int, pads: int, window: int, sinks: int) -> list[int]:
    """Columns shown to a row with `pads` pad columns: sinks (as -1000 - column) when it has more than `window`
    real tokens, then consecutive columns up to the new ones."""
    kv_offset = max(seen - window, 0)
    columns = list(range(kv_offset, seen + num_new))
    if sinks and kv_offset > pads:
        columns[:sinks] = [pads + i if pads + i >= kv_offset else -1000 - (pads + i) for i in range(sinks)]
    return columns


def test_columns_shown_follow_the_padding_rule_step_by_step():
    window, sinks, pads = 6, 2, [0, 3, 9]
    mask = torch.tensor([[0] * p + [1] * (10 - p) for p in pads])
    cache = hf_accel.SinkCache(CONFIG, window_length=window, num_sink_tokens=sinks, attention_mask=mask)
    seen = 0
    for num_new in [10, 1, 1, 3, 1, 1, 1, 1, 5, *[1] * 150]:  # crosses the buffer end: compaction happens
        shown = feed(cache, seen, num_new, rows=3)
        for row, p in enumerate(pads):
            assert shown[row] == expected_columns(seen, num_new, p, window, sinks), (seen, num_new, row)
        seen += num_new


def test_columns_by_hand():
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    cache = hf_accel.SinkCache(CONFIG, window_length=4, num_sink_tokens=1, attention_mask=mask)
    assert feed(cache, 0, 5, rows=2) == [[0, 1, 2, 3, 4]] * 2  # prefill: all of it
    assert feed(cache, 5, 1, rows=2) == [[-1000, 2, 3, 4, 5], [1, 2, 3, 4, 5]]  # row 1: 2 real tokens, no sink yet
    assert feed(cache, 6, 1, rows=2) == [[-1000, 3, 4, 5, 6], [2, 3, 4, 5, 6]]
    assert feed(cache, 7, 1, rows=2) == [[-1000, 4, 5, 6, 7], [3, 4, 5, 6, 7]]  # row 1 holds exactly its 4+1
    assert feed(cache, 8, 1, rows=2) == [[-1000, 5, 6, 7, 8], [-1003, 5, 6, 7, 8]]  # row 1's sink: column 3


def test_prompt_longer_than_the_buffer_is_returned_whole():
    cache = hf_accel.SinkCache(CONFIG, window_length=8, num_sink_tokens=2)
    assert feed(cache, 0, 200, rows=1) == [list(range(200))]
    assert feed(cache, 200, 1, rows=1) == [[-1000, -1001, *range(194, 201)]]
    assert cache.get_mask_sizes(1, 0) == (9, 193)


def test_crop_takes_back_the_last_step_beyond_the_window():
    cropped = hf_accel.SinkCache(CONFIG, window_length=6, num_sink_tokens=2)
    plain = hf_accel.SinkCache(CONFIG, window_length=6, num_sink_tokens=2)
    feed(cropped, 0, 20, rows=1), feed(plain, 0, 20, rows=1)
    feed(cropped, 20, 5, rows=1)
    cropped.crop(-3)  # keep 2 of the 5: as if only 2 had come
    assert cropped.get_seq_length() == 22
    feed(plain, 20, 2, rows=1)
    assert feed(cropped, 22, 1, rows=1) == feed(plain, 22, 1, rows=1) == [[-1000, -1001, *range(18, 23)]]
    cropped.crop(0)
    with pytest.raises(ValueError, match="at most 1"):
        cropped.crop(-2)  # the window of the next step would need column 17, evicted already
    with pytest.raises(ValueError, match="non-positive"):
        cropped.crop(2)


def test_reorder_moves_tokens_sinks_and_padding_with_the_rows():
    mask = torch.tensor([[1] * 12, [0] * 7 + [1] * 5])
    reordered = hf_accel.SinkCache(CONFIG, window_length=6, num_sink_tokens=2, attention_mask=mask)
    direct = hf_accel.SinkCache(CONFIG, window_length=6, num_sink_tokens=2, attention_mask=mask[[1, 1]])
    keys, values = column_states(2, 0, 12)
    for layer in range(2):
        reordered.update(keys, values, layer)
        direct.update(keys[[1, 1]], values[[1, 1]], layer)
    reordered.reorder_cache(torch.tensor([1, 1]))
    for first in range(12, 20):
        keys, values = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
        for layer in range(2):
            got, expected = reordered.update(keys, values, layer), direct.update(keys, values, layer)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), first


def test_memory_is_flat_between_one_and_ten_windows():
    model = transformers.LlamaForCausalLM(CONFIG).eval()
    cache = hf_accel.SinkCache(CONFIG, window_length=16, num_sink_tokens=4)
    tokens = make_prompts([16])["input_ids"]
    with torch.no_grad():
        model(tokens, past_key_values=cache)
        at_one_window = cache.memory_bytes()
        for _ in range(144):
            model(tokens[:, :1], past_key_values=cache)
    assert cache.get_seq_length() == 160
    # layers x (K, V) x kv_heads x (window + slack + sink) slots x head_dim x fp32 bytes
    assert cache.memory_bytes() == at_one_window == 2 * 2 * 2 * (16 + 64 + 4) * 16 * 4


def test_generate_builds_the_cache_with_the_prompt_padding():
    model = transformers.LlamaForCausalLM(CONFIG).eval()
    inputs = make_prompts([7, 3], seed=2)
    out = model.generate(**inputs, max_new_tokens=4, num_beams=2, num_return_sequences=2, pad_token_id=0,
                         return_dict_in_generate=True, cache_implementation="sink",
                         cache_config={"window_length": 32, "num_sink_tokens": 4})
    cache = out.past_key_values
    assert type(cache) is hf_accel.SinkCache and cache.settings.window_length == 32
    assert sorted(cache.window.pad_counts.tolist()) == [0, 0, 4, 4]  # one per beam row, whatever their order


def test_reset_forgets_tokens_and_padding():
    cache = hf_accel.SinkCache(CONFIG, window_length=6, num_sink_tokens=2, attention_mask=torch.tensor([[0, 1]]))
    feed(cache, 0, 2, rows=1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_bytes() == 0 and cache.window.pad_counts is None
    assert feed(cache, 0, 3, rows=2) == [[0, 1, 2]] * 2
