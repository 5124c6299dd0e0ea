"""Acceptance rules: exact bookkeeping on tiny tensors, and the output distribution of speculative sampling."""

import pytest
import torch

from hf_accel.speculative.verify import greedy_accept, speculative_sample


def test_greedy_accepts_the_matching_prefix_per_row():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 3, 8]])
    verdict = greedy_accept(drafts, target)
    assert verdict.num_accepted.tolist() == [3, 1, 0, 2]
    emitted = [row[:n] for row, n in zip(verdict.tokens.tolist(), verdict.num_emitted.tolist())]
    assert emitted == [[5, 6, 7, 8], [5, 6], [5], [5, 6, 3]]


def test_greedy_with_no_drafts_emits_the_target_token():
    verdict = greedy_accept(torch.empty((2, 0), dtype=torch.long), torch.tensor([[4], [9]]))
    assert verdict.num_accepted.tolist() == [0, 0] and verdict.tokens.tolist() == [[4], [9]]


def test_padding_past_a_rows_own_drafts_is_never_accepted():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    verdict = greedy_accept(drafts, target, num_drafts=torch.tensor([3, 1, 0]))
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.tokens[1, 1].item() == 6 and verdict.tokens[2, 0].item() == 5  # the target's own token there


def test_deterministic_drafts_with_padding_sample_the_bonus_from_the_target():
    # one-hot q for a row's real draft, zero rows past it: the token after the last real draft is drawn from p
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    for seed in range(10):
        verdict = speculative_sample(torch.tensor([[1, 2]]), q, p, generator=torch.Generator().manual_seed(seed),
                                     num_drafts=torch.tensor([1]))
        assert verdict.num_accepted.item() == 1 and verdict.tokens[0, :2].tolist() == [1, 2]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_accept(torch.tensor([1, 2]), torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept(torch.tensor([[1, 2]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_sample(torch.tensor([[1]]), torch.ones(1, 1, 3) / 3, torch.ones(1, 2, 4) / 4)


def test_identical_distributions_accept_everything():
    probs = torch.softmax(torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0)), -1)
    drafts = torch.multinomial(probs[:, :3].reshape(-1, 10), 1).view(3, 3)
    verdict = speculative_sample(drafts, probs[:, :3], probs)
    assert verdict.num_accepted.tolist() == [3, 3, 3]
    assert torch.equal(verdict.tokens[:, :3], drafts)


def test_a_draft_the_target_rules_out_is_rejected_and_replaced():
    # the target gives token 0 no mass, so a draft of 0 is always rejected and never emitted
    q = torch.tensor([[[0.9, 0.1, 0.0]]])
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    for seed in range(20):
        verdict = speculative_sample(torch.tensor([[0]]), q, p, generator=torch.Generator().manual_seed(seed))
        assert verdict.num_accepted.item() == 0 and verdict.tokens[0, 0].item() in (1, 2)


def _emitted_distribution(p, q, position, trials, seed=0):
    """Frequencies of the token emitted at `position` (0 = first) over `trials` rows, each with fresh drafts."""
    gen = torch.Generator().manual_seed(seed)
    k, vocab = q.shape[0], q.shape[1]
    drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True, generator=gen) for j in range(k)], 1)
    verdict = speculative_sample(drafts, q.expand(trials, k, vocab), p.expand(trials, k + 1, vocab), generator=gen)
    reached = verdict.num_emitted > position  # rows that emitted a token at this position
    tokens = verdict.tokens[reached, position]
    return torch.bincount(tokens, minlength=vocab).double() / reached.sum()


@pytest.mark.parametrize("position", [0, 1, 2])
def test_emitted_tokens_follow_the_target_distribution(position):
    # Positions are independent here (p_j does not depend on the earlier tokens), so every emitted token, accepted
    # draft, correction or bonus alike, must be distributed as p_position.
    gen = torch.Generator().manual_seed(1)
    k, vocab, trials = 2, 6, 200_000
    p = torch.softmax(2 * torch.randn(k + 1, vocab, generator=gen), -1).double()
    q = torch.softmax(2 * torch.randn(k, vocab, generator=gen), -1).double()
    freq = _emitted_distribution(p, q, position, trials)
    total_variation = 0.5 * (freq - p[position]).abs().sum().item()
    assert total_variation < 0.01, f"TV distance {total_variation:.4f} at position {position}"
    # the test can fail: the draft's own distribution is far from p
    assert 0.5 * (q[min(position, k - 1)] - p[position]).abs().sum().item() > 0.1


def test_acceptance_rate_matches_theory():
    # P(accept first draft) = sum_x min(p(x), q(x))
    gen = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(2, 5, generator=gen), -1).double()
    q = torch.softmax(torch.randn(1, 5, generator=gen), -1).double()
    trials = 100_000
    drafts = torch.multinomial(q[0], trials, replacement=True, generator=gen)[:, None]
    verdict = speculative_sample(drafts, q.expand(trials, 1, 5), p.expand(trials, 2, 5), generator=gen)
    expected = torch.minimum(p[0], q[0]).sum().item()
    assert abs(verdict.num_accepted.double().mean().item() - expected) < 0.01
