"""PrefixStore behaviour: exact hits, skipped prefill tokens (counted with a forward hook), rows of one batch with
different hits and left padding, eviction within max_memory, two threads on one store, errors, display."""

import threading

import pytest
import torch

import hf_accel
from conformance import make_model
from hf_accel import PagedCache, PrefixStore
from hf_accel.cache.prefix_store import left_padding
from tiny_llama import tiny_llama

# tiny_llama: 2 layers, 2 KV heads of dim 16, fp32 -> a block of 4 tokens is 2 * 2 (K, V) * 4 * 2 * 16 * 4 bytes
BLOCK_BYTES = 2048
HEADER = torch.randint(2, 128, (24,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 128, (length,), generator=torch.Generator().manual_seed(seed))


def batch(*rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Left-padded rows."""
    width = max(len(row) for row in rows)
    ids, mask = torch.zeros((len(rows), width), dtype=torch.long), torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :], mask[r, width - len(row) :] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def run(model, inputs, store=None, **kwargs):
    """Sequences and the tokens the prefill forward computed (summed over rows)."""
    counted = []
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, out: counted.append(args[0].numel()))
    cache = {} if store is None else {"cache_implementation": "paged",
                                      "cache_config": {"block_size": 4, "prefix_store": store}}
    kwargs.setdefault("do_sample", False)
    try:
        out = model.generate(**inputs, **cache, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                             return_dict_in_generate=True, **kwargs)
    finally:
        hook.remove()
    if store is not None:
        assert type(out.past_key_values) is PagedCache
    return out.sequences, counted[0]


def test_second_call_with_a_shared_header_skips_its_prefill(model):
    store = PrefixStore(model, max_memory=64 * BLOCK_BYTES, block_size=4)
    first, second = batch(torch.cat([HEADER, tokens(6, 1)])), batch(torch.cat([HEADER, tokens(6, 2)]))
    got, computed = run(model, first, store)
    assert torch.equal(got, run(model, first)[0]) and computed == 30
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.tokens_saved, stats.blocks, stats.bytes) == (0, 1, 0, 7, 7 * BLOCK_BYTES)
    got, computed = run(model, second, store)
    assert torch.equal(got, run(model, second)[0])
    assert computed == 6  # the 24 header tokens (6 blocks) came from the store
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.tokens_saved, stats.blocks) == (1, 1, 24, 8)
    store.clear()  # forgets the blocks and frees their memory; the next call computes its whole prompt again
    assert store.stats().blocks == store.stats().bytes == store._arena.nbytes == 0
    got, computed = run(model, second, store)
    assert torch.equal(got, run(model, second)[0]) and computed == 30


def test_the_last_prompt_token_is_always_computed(model):
    store = PrefixStore(model, max_memory=64 * BLOCK_BYTES, block_size=4)
    prompt = batch(HEADER[:16])
    run(model, prompt, store)
    got, computed = run(model, prompt, store)
    assert torch.equal(got, run(model, prompt)[0])
    assert computed == 4  # blocks 0-2 from the store; block 3 holds the last token, so it is computed


def test_rows_with_different_hits_and_left_padding(model):
    store = PrefixStore(model, max_memory=64 * BLOCK_BYTES, block_size=4)
    run(model, batch(HEADER), store)  # stores the 6 header blocks
    rows = batch(torch.cat([HEADER, tokens(8, 3)]),  # pad 0, hit 24
                 torch.cat([HEADER[:16], tokens(10, 4)]),  # pad 6, hit 16 -> the batch skips 6 + 16 = 22 columns
                 torch.cat([HEADER, tokens(4, 5)]))  # pad 4, hit 24
    got, computed = run(model, rows, store)
    assert torch.equal(got, run(model, rows)[0])
    assert computed == 3 * (32 - 22)
    assert store.stats().tokens_saved == 22 + (22 - 6) + (22 - 4)


def test_sampling_and_beams_with_a_warm_store(model):
    store = PrefixStore(model, max_memory=64 * BLOCK_BYTES, block_size=4)
    prompts = batch(torch.cat([HEADER, tokens(5, 6)]), torch.cat([HEADER[:20], tokens(3, 7)]))
    for kwargs in ({"num_beams": 3, "num_return_sequences": 2}, {"do_sample": True, "num_return_sequences": 3}):
        results = []
        for side in (None, store, store):
            torch.manual_seed(11)
            results.append(run(model, prompts, side, **kwargs))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][0], results[2][0])
        assert results[2][1] < results[0][1]


def test_eviction_keeps_outputs_identical_and_bytes_within_max_memory(model):
    limit = 10 * BLOCK_BYTES
    store = PrefixStore(model, max_memory=limit, block_size=4)
    for seed, which in enumerate([0, 1, 0, 2, 0, 1]):  # 5 blocks a prompt: header 1 comes back after being evicted
        header = tokens(16, 100 + which)
        prompt = batch(torch.cat([header, tokens(7, seed)]))
        assert torch.equal(run(model, prompt, store)[0], run(model, prompt)[0])
        assert store.stats().bytes <= limit
        assert store._arena.nbytes <= limit + BLOCK_BYTES  # the arena: the blocks held and at most one free slot
    stats = store.stats()
    assert stats.evictions > 0 and stats.hits > 0 and stats.blocks <= 10


def test_two_threads_share_one_store(model):
    store = PrefixStore(model, max_memory=40 * BLOCK_BYTES, block_size=4)
    prompts = [batch(torch.cat([HEADER, tokens(3 + i, 200 + i)])) for i in range(6)]
    expected = [run(model, p)[0] for p in prompts]
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(indices):
        try:
            start.wait()
            for i in indices:
                got[i] = run(model, prompts[i], store)[0]
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(range(k, 6, 2),)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert all(torch.equal(got[i], expected[i]) for i in range(6))
    assert store.stats().hits >= 4


def test_sliding_layers_evict_again_after_the_prefill():
    model = make_model("mistral", torch.float32, "sdpa")  # every layer slides (window 8)
    store = PrefixStore(model, max_memory="1MiB", block_size=4)
    prompt = batch(tokens(20, 9) % 150 + 4)
    for _ in range(2):
        out = model.generate(**prompt, cache_implementation="paged",
                             cache_config={"block_size": 4, "prefix_store": store}, max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        group = out.past_key_values.groups[0]
        assert group.tables.first_token > 0 and not group.is_recording_past
        assert group.tables.pool.num_used_blocks <= group.tables.blocks_for(8) + 1
    assert store.stats().tokens_saved == 16


def test_left_padding():
    ids = torch.ones((3, 4), dtype=torch.long)
    assert left_padding(ids, None) == [0, 0, 0]
    assert left_padding(ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])) == [2, 0, 1]
    assert left_padding(ids, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])) is None  # right padding
    assert left_padding(ids, torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1]])) is None  # a hole


def test_right_padded_prompts_do_not_use_the_store(model):
    store = PrefixStore(model, max_memory=64 * BLOCK_BYTES, block_size=4)
    inputs = {"input_ids": torch.stack([HEADER, HEADER]), "attention_mask": torch.ones((2, 24), dtype=torch.long)}
    inputs["attention_mask"][1, -2:] = 0
    run(model, inputs, store)
    assert store.stats().blocks == 0


# --- errors ---------------------------------------------------------------------------------------------------------


def test_bad_max_memory_and_block_size(model):
    with pytest.raises(ValueError, match="`max_memory` must be an int number of bytes or a string"):
        PrefixStore(model, max_memory="lots")
    with pytest.raises(TypeError, match="`max_memory`"):
        PrefixStore(model, max_memory=True)
    with pytest.raises(ValueError, match="`max_memory` must be positive"):
        PrefixStore(model, max_memory=0)
    with pytest.raises(ValueError, match=r"`max_memory` \(2047 bytes\) is below one block of this model \(2048"):
        PrefixStore(model, max_memory=BLOCK_BYTES - 1, block_size=4)
    with pytest.raises(ValueError, match="`block_size` must be a positive int"):
        PrefixStore(model, block_size=0)
    with pytest.raises(TypeError, match="`block_size` must be a positive int"):
        PrefixStore(model, block_size="16")
    with pytest.raises(TypeError, match="`model` must be a transformers PreTrainedModel, got str"):
        PrefixStore("model")


def test_store_of_another_model_block_size_or_dtype(model):
    store = PrefixStore(model, block_size=4)
    with pytest.raises(ValueError, match="`prefix_store` was built for another model"):
        run(tiny_llama(), batch(HEADER), store)
    with pytest.raises(ValueError, match=r"`block_size` of the paged cache \(16\) must equal the prefix_store's "
                                         r"block_size \(4\)"):
        PagedCache(model.config, prefix_store=store)
    cast = tiny_llama()
    cast_store = PrefixStore(cast, block_size=4)
    cast.to(torch.bfloat16)
    with pytest.raises(ValueError, match="`prefix_store` holds torch.float32 K/V but the model now runs in "
                                         "torch.bfloat16"):
        run(cast, batch(HEADER), cast_store)
    with pytest.raises(TypeError, match="`prefix_store` must be a hf_accel.PrefixStore or None, got dict"):
        PagedCache(model.config, prefix_store={})


@pytest.mark.parametrize("cache", [{"cache_implementation": "sink"}, {"cache_implementation": "dynamic"}, {}])
def test_prefix_store_needs_the_paged_cache(model, cache):
    store = PrefixStore(model, block_size=4)
    with pytest.raises(ValueError, match=r"`cache_config\['prefix_store'\]` needs cache_implementation='paged'"):
        model.generate(**batch(HEADER), **cache, cache_config={"prefix_store": store}, max_new_tokens=2)


def test_display(model):
    store = PrefixStore(model, max_memory="1MiB", block_size=4)
    run(model, batch(HEADER), store)
    assert repr(store) == ("PrefixStore(block_size=4, blocks=6, memory=12.0 KiB / 1.0 MiB, hits=0, misses=1, "
                           "tokens_saved=0, evictions=0)")
    assert "<table" in store._repr_html_() and "tokens_saved" in store._repr_html_()
    assert hf_accel.PrefixStoreStats is type(store.stats())
