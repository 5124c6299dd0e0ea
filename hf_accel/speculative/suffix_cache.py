"""`SuffixCache`: a suffix tree over token sequences with frequency counts, the n-gram drafter's memory
(SuffixDecoding, Oliaro et al. 2024): which tokens followed the longest tail of a context that occurred before, and
how often. Plain Python, no torch.

Shape: a trie of every substring (n-gram) of the stored sequences up to `max_depth` tokens; a node is an n-gram and
its `count` the number of its occurrences. A node that occurred once grows no children: it is a leaf that stands for
its whole chain of count-1 descendants, read from its one occurrence in the stored sequence (`seq`, `end`), so a
sequence adds about one node per token plus one per repeated n-gram, not `max_depth` per token. Each sequence keeps
its last `max_depth` suffixes' places in the tree (`_active`), so a token appended costs O(max_depth) at most, and in
practice only the suffixes that occurred before: a suffix that occurred once is a leaf, every longer one then also
occurred once, and a leaf's chain grows by itself (its place is kept as where its reading started, so it needs no
update per token).

Rules:
- a node's count is the number of occurrences of its n-gram; the root's is the number of tokens stored;
- count 1 <=> leaf: `children` is None and `tokens[seq][end - depth : end]` is the n-gram's one occurrence, whose
  continuation `tokens[seq][end:]` is the leaf's chain, also while `seq` still grows;
- a node with count >= 2 has a child for every token that follows one of its occurrences, up to depth `max_depth`;
  `best` is its child with the highest count (the most recent to reach it on ties); `(seq, end)` is its most recent
  occurrence;
- `speculate` follows, from the n-gram matching the context's last m tokens, the most frequent child at each step;
  a token's probability is the product of count(child) / count(parent) along the way (the chance that the path so far
  continues, as counted), cut below `min_probability`; along a leaf's chain, and past depth `max_depth` along the
  node's most recent occurrence, the probability stays. Of the drafts for every match length m the one with the
  most expected accepted tokens (the sum of the probabilities) wins, the longer match on ties (followed longest
  first, until a shorter match's token limit is no more than the best score: it could not win).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cache.settings import check_int


class _Node:
    __slots__ = ("token", "count", "children", "best", "seq", "end")

    def __init__(self, token: int, seq: int, end: int):
        self.token = token
        self.count = 1
        self.children: dict[int, _Node] | None = None  # None: a leaf (count 1)
        self.best: _Node | None = None
        self.seq, self.end = seq, end  # a leaf's one occurrence, a node's most recent: tokens[seq][end - depth:end]


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed continuation of a context: `tokens`, and for each the estimated probability that it and every token
    before it are right (`probabilities`, non-increasing); `match_length`: context tokens matched (0: no match);
    `source`: where it was found (a drafter's label, e.g. "own" or "shared")."""

    tokens: list[int]
    probabilities: list[float]
    match_length: int = 0
    source: str = ""

    @property
    def score(self) -> float:
        """Expected number of accepted tokens, as the counts estimate it."""
        return sum(self.probabilities)


NO_DRAFT = Draft([], [], 0)


class SuffixCache:
    """Token sequences (earlier outputs, a request's own prompt and output, ...) in a suffix tree with counts, for
    `ngram_generate` and any engine to draft from; share one object across calls and requests.

    Args:
        max_depth: longest n-gram counted (and longest match).
        max_sequences: keep at most this many sequences (the oldest quarter is dropped when one more would not fit,
            and the tree rebuilt from the rest); None keeps everything.
    """

    def __init__(self, max_depth: int = 24, max_sequences: int | None = None):
        check_int("max_depth", max_depth, 2, "an int >= 2")
        if max_sequences is not None:
            check_int("max_sequences", max_sequences, 1, "a positive int or None")
        self.max_depth, self.max_sequences = max_depth, max_sequences
        self._sequences: list[list[int]] = []
        # per sequence: where its last suffixes end, longest first, as (node, origin): the suffix has read
        # len(tokens) - origin tokens along node's chain (a leaf's reading grows with the sequence by itself)
        self._active: list[list[tuple[_Node, int]]] = []
        self._root = _Node(-1, -1, 0)
        self._root.count, self._root.children = 0, {}

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_tokens(self) -> int:
        return self._root.count

    def add(self, token_ids: Sequence[int]) -> int:
        """Store a new sequence; returns its id for `extend` (ids are positions: they shift when old ones go)."""
        if self.max_sequences is not None and len(self._sequences) >= self.max_sequences:
            self._drop_oldest(max(1, self.max_sequences // 4))
        self._sequences.append([])
        self._active.append([])
        seq = len(self._sequences) - 1
        self.extend(seq, token_ids)
        return seq

    def extend(self, seq: int, token_ids: Sequence[int]) -> None:
        """Append tokens to stored sequence `seq` (a growing output): every n-gram ending at them is counted."""
        tokens, active = self._sequences[seq], self._active[seq]
        for token in token_ids:
            tokens.append(int(token))
            active.append((self._root, len(tokens) - 1))  # the new token starts a suffix (read 0 at the root)
            if len(active) > self.max_depth:
                del active[0]
            self._count_suffixes(seq, tokens, active)

    def _count_suffixes(self, seq: int, tokens: list[int], active: list[tuple[_Node, int]]) -> None:
        # count the n-grams ending at the new last token. Entry i of `active` is the suffix of length size - i, which
        # before this token ended end - 1 - origin tokens past its node, along the node's chain. The suffixes at a
        # leaf are the longest ones (a suffix that occurred once makes every longer one occur once): their chains grow
        # by themselves (their origins stay). The others are counted, longest first.
        end, token, size = len(tokens), tokens[-1], len(active)
        first = size
        while first and active[first - 1][0].children is not None:
            first -= 1
        for i in range(first, size):
            node, origin = active[i]
            read = end - 1 - origin
            if read:  # the leaf it read along was split since: go on down the path
                while read and node.children is not None:
                    node = node.children[tokens[end - 1 - read]]
                    read -= 1
                if node.children is None:  # still along a leaf's chain: its one occurrence is this one
                    active[i] = (node, end - 1 - read)
                    continue
            active[i] = (self._count_child(node, token, seq, end, size - i), end)

    def count(self, ngram: Sequence[int]) -> int:
        """Occurrences of `ngram` (1 to `max_depth` tokens) in the stored sequences."""
        if not 1 <= len(ngram) <= self.max_depth:
            raise ValueError(f"`ngram` must hold 1 to max_depth={self.max_depth} tokens, got {len(ngram)}")
        found = self._match(ngram)
        return 0 if found is None else found[0].count

    def speculate(self, context: Sequence[int], max_tokens: int, min_probability: float = 0.1,
                  tokens_per_match: float = 1.0, extra_tokens: float = 0.0, continuing: int | None = None) -> Draft:
        """The best draft (see the module docstring) of at most `max_tokens` tokens continuing `context`; a match of
        m tokens drafts at most `tokens_per_match * m + extra_tokens` (SuffixDecoding's adaptive length). Returns
        `NO_DRAFT` when the context's last token never occurred.

        `continuing`: the id of the stored sequence that `context` is (prompt lookup: a request matched against its
        own tokens). Its occurrence at the very end is then not counted as a match, and a match running into the end
        continues with the draft itself (the text repeats with the match's period, as an LZ77 copy does)."""
        matches = []  # where the context's last m tokens end, m = 1, 2, ...
        for m in range(1, min(len(context), self.max_depth - 1) + 1):
            found = self._match(context[len(context) - m :])
            if found is None or (continuing is not None and found[0].count == 1):
                break  # no (earlier) occurrence; a longer tail contains this one: it has none either
            matches.append(found)
        best = NO_DRAFT
        for m in range(len(matches), 0, -1):  # longest first: a shorter match must score more to win
            limit = min(max_tokens, int(tokens_per_match * m + extra_tokens + 1e-6))
            if best.tokens and best.score >= limit:
                break  # a draft of `limit` tokens scores `limit` at most: no shorter match can win
            draft = self._follow(*matches[m - 1], m, limit, min_probability, continuing)
            if draft.tokens and (draft.score > best.score or not best.tokens):
                best = draft
        return best

    def _count_child(self, node: _Node, token: int, seq: int, end: int, depth: int) -> _Node:
        # one more occurrence of node's n-gram + token (ending at tokens[seq][end - 1], `depth` tokens long)
        if node is self._root:
            node.count += 1
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node(token, seq, end)
        else:
            if child.children is None:
                self._grow_children(child, depth)
            child.count += 1
            child.seq, child.end = seq, end
        if node.best is None or child.count >= node.best.count:
            node.best = child
        return child

    def _grow_children(self, leaf: _Node, depth: int) -> None:
        # a leaf about to count a second occurrence gets the child its first occurrence continues with
        leaf.children = {}
        tokens = self._sequences[leaf.seq]
        if leaf.end < len(tokens) and depth < self.max_depth:
            leaf.best = leaf.children[tokens[leaf.end]] = _Node(tokens[leaf.end], leaf.seq, leaf.end + 1)

    def _match(self, tail: Sequence[int]) -> tuple[_Node, int, int] | None:
        """Where `tail` ends: (node, its depth, tokens read past it along a leaf's chain), or None."""
        node, depth = self._root, 0
        for i, token in enumerate(tail):
            if node.children is None:
                tokens = self._sequences[node.seq]
                chain = tail[i:]
                start = node.end
                if list(chain) != tokens[start : start + len(chain)]:
                    return None
                return node, depth, len(chain)
            node = node.children.get(token)
            if node is None:
                return None
            depth += 1
        return node, depth, 0

    def _follow(self, node: _Node, depth: int, read: int, match_length: int, limit: int, min_probability: float,
                continuing: int | None) -> Draft:
        tokens: list[int] = []
        probabilities: list[float] = []
        probability, seen = 1.0, node.count - (continuing is not None)  # occurrences before the context's end
        while len(tokens) < limit:
            if node.children is None or depth == self.max_depth:  # along one occurrence: the probability stays
                token = self._chain_token(node, read, continuing, tokens)
                if token is None:
                    break
                tokens.append(token)
                read += 1
            else:
                child = node.best
                if child is None or seen <= 0:
                    break
                probability *= min(child.count / seen, 1.0)
                if probability < min_probability:
                    break
                tokens.append(child.token)
                node, depth, seen = child, depth + 1, child.count
            probabilities.append(probability)
        return Draft(tokens, probabilities, match_length)

    def _chain_token(self, node: _Node, read: int, continuing: int | None, draft: list[int]) -> int | None:
        chain, index = self._sequences[node.seq], node.end + read
        if index < len(chain):
            return chain[index]
        if node.seq == continuing and index - len(chain) < len(draft):
            return draft[index - len(chain)]  # the match runs into the context's end: copy on from the draft
        return None

    def _drop_oldest(self, count: int) -> None:
        kept = self._sequences[count:]
        self._sequences, self._active = [], []
        self._root = _Node(-1, -1, 0)
        self._root.count, self._root.children = 0, {}
        for tokens in kept:
            self.add(tokens)
