"""`SuffixCache` and `NgramDrafter`, model-free: exact n-gram counts against brute force (sequences added whole, grown
token by token, and grown in turns), the draft rule (most frequent continuation, probabilities as count ratios, the
minimum probability, the length per matched token, the longer match on ties, the best over every match length),
prompt lookup on a sequence's own tokens (its last occurrence not counted, periodic text copied on), the shared
cache beating a sequence's own matches, eviction."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel import NgramSettings, SuffixCache
from hf_accel.speculative.ngram_drafter import NgramDrafter


def _brute_counts(sequences, depth):
    counts = collections.Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for length in range(1, min(depth, len(seq) - start) + 1):
                counts[tuple(seq[start : start + length])] += 1
    return counts


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 6), st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=4), st.data())
def test_counts_equal_brute_force_whole_or_grown(depth, sequences, data):
    cache = SuffixCache(max_depth=depth)
    cut = [data.draw(st.integers(0, len(seq))) for seq in sequences]
    ids = [cache.add(seq[:c]) for seq, c in zip(sequences, cut)]
    for seq_id, seq, c in zip(ids, sequences, cut):  # grow every sequence after all were started
        for token in seq[c:]:
            cache.extend(seq_id, [token])
    expected = _brute_counts(sequences, depth)
    for ngram, count in expected.items():
        assert cache.count(ngram) == count, ngram
    assert cache.count([9]) == 0 and cache.num_tokens == sum(map(len, sequences))


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 6), st.lists(st.lists(st.integers(0, 2), max_size=14), min_size=2, max_size=4), st.data())
def test_counts_equal_brute_force_with_sequences_grown_in_turns(depth, sequences, data):
    """Sequences grown a few tokens at a time in drawn turns: one sequence's counting splits the leaves another is
    reading along (its next token must go down the split path), and every count still equals brute force."""
    cache = SuffixCache(max_depth=depth)
    ids = [cache.add([]) for _ in sequences]
    grown = [0] * len(sequences)
    while any(g < len(seq) for g, seq in zip(grown, sequences)):
        k = data.draw(st.sampled_from([k for k, seq in enumerate(sequences) if grown[k] < len(seq)]))
        step = data.draw(st.integers(1, 3))
        cache.extend(ids[k], sequences[k][grown[k]: grown[k] + step])
        grown[k] = min(len(sequences[k]), grown[k] + step)
    for ngram, count in _brute_counts(sequences, depth).items():
        assert cache.count(ngram) == count, ngram


def _every_match_draft(cache, context, max_tokens, min_probability, tokens_per_match, extra_tokens, continuing):
    """The draft rule taken literally: every match length's draft, the best score winning, the longer on ties."""
    best = None
    for m in range(1, min(len(context), cache.max_depth - 1) + 1):
        found = cache._match(context[len(context) - m :])
        if found is None or (continuing is not None and found[0].count == 1):
            break
        limit = min(max_tokens, int(tokens_per_match * m + extra_tokens + 1e-6))
        draft = cache._follow(*found, m, limit, min_probability, continuing)
        if draft.tokens and (best is None or draft.score >= best.score):
            best = draft
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), max_size=24), min_size=1, max_size=3), st.lists(st.integers(0, 2),
       min_size=1, max_size=12), st.integers(1, 8), st.sampled_from([0.0, 0.3]), st.sampled_from([0.5, 1.0, 2.0]),
       st.booleans())
def test_speculate_is_the_best_draft_over_every_match_length(sequences, context, max_tokens, min_probability,
                                                             tokens_per_match, own):
    """`speculate` stops following shorter matches once none can win; what it returns is still the draft of the
    literal rule (every match length, the best score, the longer match on ties), against others' sequences and as
    prompt lookup on a sequence's own tokens."""
    cache = SuffixCache(max_depth=6)
    for seq in sequences:
        cache.add(seq)
    continuing = cache.add(context) if own else None
    cut = (max_tokens, min_probability, tokens_per_match, 1.0)
    expected = _every_match_draft(cache, context, *cut, continuing)
    draft = cache.speculate(context, *cut, continuing=continuing)
    if expected is None:
        assert not draft.tokens
    else:
        assert (draft.tokens, draft.probabilities, draft.match_length) == \
            (expected.tokens, expected.probabilities, expected.match_length)


def test_draft_follows_the_most_frequent_continuation_with_count_ratios():
    cache = SuffixCache(max_depth=8)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6]):
        cache.add(seq)
    draft = cache.speculate([9, 1, 2], max_tokens=4, min_probability=0.0, tokens_per_match=4)
    # "2" (and "1 2") occurred 3 times: followed by 3 twice, by 5 once; "2 3" always by 4
    assert draft.tokens == [3, 4] and draft.match_length == 2  # the longer match on equal scores
    assert draft.probabilities == pytest.approx([2 / 3, 2 / 3])
    assert draft.score == pytest.approx(4 / 3) and cache.count([1, 2]) == 3 and cache.count([2, 3, 4]) == 2


def test_minimum_probability_and_length_per_matched_token_cut_the_draft():
    cache = SuffixCache(max_depth=8)
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 6, 7, 8]):
        cache.add(seq)
    assert cache.speculate([1, 2], 8, min_probability=0.7, tokens_per_match=8).tokens == []
    assert cache.speculate([1, 2], 8, min_probability=0.5, tokens_per_match=8).tokens == [3, 4, 5]
    assert cache.speculate([1, 2], 8, min_probability=0.5, tokens_per_match=1).tokens == [3, 4]  # 2 matched
    assert cache.speculate([1, 2], 8, min_probability=0.5, tokens_per_match=1, extra_tokens=1).tokens == [3, 4, 5]
    assert cache.speculate([1, 2], 2, min_probability=0.0, tokens_per_match=8).tokens == [3, 4]  # max_tokens


def test_a_longer_match_wins_where_it_expects_as_many_tokens():
    cache = SuffixCache(max_depth=8)
    cache.add([5, 1, 2, 3, 1, 4, 1, 4, 1, 4])  # after "1": 4 three times, 2 once; after "5 1": always 2
    one = cache.speculate([1], 2, min_probability=0.0, tokens_per_match=1, extra_tokens=1)
    assert one.tokens == [4, 1] and one.probabilities == pytest.approx([0.75, 0.5])  # "1 4" then "1" 2 of 3
    draft = cache.speculate([5, 1], 2, min_probability=0.0, tokens_per_match=1)
    assert draft.match_length == 2 and draft.tokens == [2, 3] and draft.score == pytest.approx(2.0)


def test_no_match_gives_no_draft():
    cache = SuffixCache()
    cache.add([1, 2, 3])
    assert cache.speculate([4], 5).tokens == [] and cache.speculate([3], 5).tokens == []  # 3 is never followed


def test_prompt_lookup_matches_earlier_occurrences_in_the_sequence_itself():
    drafter = NgramDrafter(NgramSettings(tokens_per_match=4, extra_tokens=0))
    context = [10, 11, 12, 13, 14, 20, 21, 11, 12]
    draft = drafter.draft(context, max_tokens=3)
    assert draft.tokens == [13, 14, 20] and draft.match_length == 2
    assert draft.probabilities == pytest.approx([1.0, 1.0, 1.0])  # the occurrence at the end is not counted
    assert drafter.draft(context + [30], max_tokens=3).tokens == []  # 30 never occurred before
    assert drafter.num_seen == len(context) + 1


def test_prompt_lookup_copies_periodic_text_past_the_end():
    drafter = NgramDrafter(NgramSettings(tokens_per_match=8, extra_tokens=8))
    draft = drafter.draft([7, 1, 2, 3, 1, 2, 3, 1], max_tokens=7)
    assert draft.tokens == [2, 3, 1, 2, 3, 1, 2]  # the match at distance 3 runs into the end: copied on


def test_frequency_counts_decide_between_earlier_continuations():
    context = [3, 1, 5, 4, 1, 5, 6, 1, 7, 8, 1]  # "1" before the end: followed by 5 twice, by 7 once
    drafter = NgramDrafter(NgramSettings(min_probability=0.0, tokens_per_match=1))
    draft = drafter.draft(context, max_tokens=1)
    assert draft.tokens == [5] and draft.probabilities == pytest.approx([2 / 3])
    cut = NgramDrafter(NgramSettings(min_probability=0.7, tokens_per_match=1))
    assert cut.draft(context, max_tokens=1).tokens == []


def test_shared_cache_wins_when_it_expects_more_and_own_matches_on_ties():
    shared = SuffixCache()
    shared.add([3, 4, 5, 6, 7, 8])
    drafter = NgramDrafter(NgramSettings(tokens_per_match=8), shared)
    draft = drafter.draft([1, 2, 3, 4], max_tokens=4)
    assert draft.tokens == [5, 6, 7, 8] and draft.source == "shared"  # only the shared cache knows
    own = NgramDrafter(NgramSettings(tokens_per_match=8), shared)
    draft = own.draft([3, 4, 9, 3, 4], max_tokens=4)
    assert draft.tokens == [9, 3, 4, 9] and draft.source == "own"  # 1.0 per token both: own wins


def test_oldest_sequences_are_dropped_beyond_max_sequences():
    cache = SuffixCache(max_sequences=4)
    for first in range(6):
        cache.add([first, 100 + first])
    assert cache.num_sequences == 4  # at the 5th add the oldest quarter (1) went, at the 6th one more
    assert cache.count([0]) == 0 and cache.count([1, 101]) == 0 and cache.count([2, 102]) == 1


@pytest.mark.parametrize("kwargs,error,name", [
    ({"max_depth": 1}, ValueError, "max_depth"), ({"max_depth": 2.5}, TypeError, "max_depth"),
    ({"max_sequences": 0}, ValueError, "max_sequences"),
])
def test_bad_cache_settings_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        SuffixCache(**kwargs)


@pytest.mark.parametrize("kwargs,error,name", [
    ({"min_probability": 1.5}, ValueError, "min_probability"), ({"tokens_per_match": -1}, ValueError, "tokens_per"),
    ({"extra_tokens": "2"}, TypeError, "extra_tokens"), ({"max_depth": 0}, ValueError, "max_depth"),
])
def test_bad_ngram_settings_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        NgramSettings(**kwargs)
