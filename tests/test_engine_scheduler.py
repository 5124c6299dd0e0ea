"""Block manager and scheduler bookkeeping, exact on tiny numbers (no model): block ids, prefix-cache hits and LRU
eviction, chunked prefill, priorities, preemption; and a hypothesis state machine over both."""

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_accel import SamplingParams
from hf_accel.engine.block_manager import BlockManager
from hf_accel.engine.outputs import RequestTiming
from hf_accel.engine.scheduler import Scheduler, SchedulerConfig
from hf_accel.engine.sequence import Request, Sequence, SequenceStatus, make_sequences

_arrivals = itertools.count()


def make_seq(tokens: list[int], priority: int = 0, max_tokens: int = 8) -> Sequence:
    request = Request(f"r{next(_arrivals)}", None, list(tokens), SamplingParams(max_tokens=max_tokens,
                      priority=priority), next(_arrivals), RequestTiming(0.0))
    make_sequences(request, lambda params: None)
    return request.sequences[0]


def run_step(scheduler: Scheduler) -> list[tuple[Sequence, int]]:
    """Schedule one step and apply it as the engine would, sampling token 7 for every sequence that finishes its
    uncomputed tokens."""
    batch = scheduler.schedule()
    planned = [(s.seq, s.num_new) for s in batch.scheduled]
    for s in batch.scheduled:
        if s.samples:
            s.seq.token_ids.append(7)
    scheduler.postprocess(batch, {})
    return planned


def test_blocks_and_prefix_hits_exact():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(list(range(10)))
    assert blocks.allocate_with_prefix(first, 10)
    assert first.block_ids == [0, 1, 2] and first.num_computed_tokens == 0
    first.num_computed_tokens = 10
    blocks.cache_full_blocks(first)
    assert blocks.num_cached_blocks == 2 and blocks.pool.refcount(0) == 1  # the sequence (the cache holds none)
    second = make_seq(list(range(9)) + [99])
    assert blocks.allocate_with_prefix(second, 10)
    assert second.block_ids == [0, 1, 3] and second.num_computed_tokens == 8
    assert blocks.stats.hits == 8 and blocks.stats.queries == 20
    exact = make_seq(list(range(8)))  # all 8 tokens cached, but the last must be computed: one block reused
    assert blocks.match_prefix(exact) == [0]
    for seq in (first, second):
        blocks.free(seq)
    assert blocks.pool.num_used_blocks == 0 and blocks.num_free_blocks == 8 and blocks.num_cached_blocks == 2
    assert list(blocks.pool._cached_free) == [1, 0]  # freed tail first: the tail is evicted first


def test_lru_eviction_when_blocks_run_short():
    blocks = BlockManager(num_blocks=4, block_size=2)
    old = make_seq([1, 2, 3, 4, 5])
    assert blocks.allocate_with_prefix(old, 5)
    old.num_computed_tokens = 5
    blocks.cache_full_blocks(old)
    blocks.free(old)
    assert blocks.num_cached_blocks == 2 and blocks.pool.num_free_blocks == 4  # 2 uncached, then 2 cached
    new = make_seq([9, 9, 9, 9, 9, 9, 9])
    assert blocks.allocate_with_prefix(new, 7)
    assert sorted(new.block_ids) == [0, 1, 2, 3] and blocks.num_cached_blocks == 0
    new.num_computed_tokens = 7
    assert not blocks.allocate(new, 2)  # 9 tokens need a fifth block: refused, nothing changed
    assert len(new.block_ids) == 4


def test_decodes_first_then_chunked_prefill():
    blocks = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), blocks)
    short, long = make_seq([1, 2, 3]), make_seq(list(range(20)))
    scheduler.add(short)
    assert run_step(scheduler) == [(short, 3)]
    scheduler.add(long)
    assert [(s, n) for s, n in run_step(scheduler)] == [(short, 1), (long, 7)]
    assert [(s, n) for s, n in run_step(scheduler)] == [(short, 1), (long, 7)]
    assert [(s, n) for s, n in run_step(scheduler)] == [(short, 1), (long, 6)]
    assert long.num_computed_tokens == 20 and long.num_tokens == 21


def test_priority_then_arrival_order_and_max_num_seqs():
    blocks = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), blocks)
    low, high, later_high = make_seq([1, 2], priority=5), make_seq([3, 4], priority=-1), make_seq([5], priority=-1)
    for seq in (low, later_high, high):
        scheduler.add(seq)
    assert scheduler.waiting == [high, later_high, low]
    assert run_step(scheduler) == [(high, 2)]
    scheduler.remove(high)
    assert run_step(scheduler) == [(later_high, 1)]


def test_preemption_frees_the_last_sequence_and_requeues_it():
    blocks = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), blocks)
    first, second = make_seq([1, 2, 3]), make_seq([4])
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)  # first: 3 tokens in 2 blocks; second: 1 block (admitted with one block kept spare)
    assert blocks.num_free_blocks == 1
    run_step(scheduler)  # first's 4th token and second's 2nd token fit the blocks they have
    batch = scheduler.schedule()  # first takes the last block; second needs one too: it (last in order) is preempted
    assert batch.preempted == [second] and batch.seqs == [first]
    assert second.status is SequenceStatus.WAITING and second.block_ids == [] and second.num_computed_tokens == 0
    assert second.token_ids == [4, 7, 7] and scheduler.num_preemptions == 1  # keeps its outputs


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, steps, finishes and aborts over a tiny pool: no block leaks, is freed twice, or is written
    while another sequence or the prefix cache also holds it."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(num_blocks=6, block_size=2)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=5), self.blocks)
        self.live: list[Sequence] = []

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=6), priority=st.integers(0, 2))
    def add(self, prompt, priority):
        seq = make_seq(prompt, priority)
        self.scheduler.add(seq)
        self.live.append(seq)

    @rule()
    def step(self):
        batch = self.scheduler.schedule()
        for seq, num in ((s.seq, s.num_new) for s in batch.scheduled):
            size = self.blocks.block_size
            written = {seq.block_ids[p // size] for p in range(seq.num_computed_tokens, seq.num_computed_tokens + num)}
            for block in written:
                assert self.blocks.pool.refcount(block) == 1 and self.blocks.pool.key_of(block) is None, "shared write"
        for s in batch.scheduled:
            if s.samples:
                s.seq.token_ids.append(1 + s.seq.num_tokens % 3)
        self.scheduler.postprocess(batch, {})
        assert batch.num_tokens <= 5 and len(self.scheduler.running) <= 3

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish_or_abort(self, index):
        seq = self.live.pop(index % len(self.live))
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED

    @invariant()
    def blocks_balance(self):
        held = [b for seq in self.live for b in seq.block_ids]
        for block in range(self.blocks.num_blocks):
            assert self.blocks.pool.refcount(block) == held.count(block), f"block {block}"
        for seq in self.live:
            assert len(seq.block_ids) * 2 >= seq.num_computed_tokens
        queued = self.scheduler.waiting + self.scheduler.running
        assert sorted(s.seq_id for s in queued) == sorted(s.seq_id for s in self.live), "a sequence was lost"


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
