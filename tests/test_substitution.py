"""Importance-driven substitution: the score bands, order independence, weights, and α = 0 changing nothing."""
from __future__ import annotations

import numpy as np
import pytest

from coe import CoEError
from routing.substitution import WeightRule, substitute


def _scores(*rows):
    return np.array(rows, dtype=np.float64)


def test_bands_decide_what_is_kept_and_what_is_replaced():
    # k = 2; S (3rd score) = 0.20; alpha 0.3: top > 0.26, low in (0.20, 0.26], substitutes in (0.14, 0.20]
    s = _scores([0.40, 0.25, 0.20, 0.15, 0.0])
    got = substitute(s, [[0, 1]], resident={0, 3}, alpha=0.3, rule=WeightRule())
    assert got.chosen.tolist() == [[0, 3]] and got.substituted == 1 and got.changed.tolist() == [True]
    # the substitute's weight is its own score, renormalised over the final pair
    assert got.weights[0].tolist() == pytest.approx([0.40 / 0.55, 0.15 / 0.55])
    # a low-score expert that is resident stays; a top-score one that is missing stays (it will be loaded)
    assert substitute(s, [[0, 1]], resident={1}, alpha=0.3, rule=WeightRule()).chosen.tolist() == [[0, 1]]
    # no substitute inside (1-alpha)S..S: the low-score expert stays and is counted as missing
    far = _scores([0.40, 0.25, 0.20, 0.05, 0.0])
    got = substitute(far, [[0, 1]], resident={0, 4}, alpha=0.3, rule=WeightRule())
    assert got.chosen.tolist() == [[0, 1]] and got.substituted == 0 and got.missing_low == 1


def test_alpha_zero_changes_nothing():
    rng = np.random.default_rng(0)
    s = rng.dirichlet(np.ones(8), size=50)
    chosen = np.argsort(-s, axis=1)[:, :2]
    got = substitute(s, chosen, resident={0, 1}, alpha=0.0, rule=WeightRule())
    assert (got.chosen == chosen).all() and got.substituted == 0 and not got.changed.any()


def test_top_score_set_is_built_over_the_batch_first():
    # token 1's low-score expert 2 is top-score for token 0, so it is kept, whichever token comes first
    a = [0.10, 0.15, 0.60, 0.15, 0.0]      # S=0.15: 2 is top-score here
    b = [0.50, 0.09, 0.23, 0.20, 0.0]      # S=0.20: 2 is low-score here (0.20 < 0.23 <= 0.26)
    for rows, ch in (([a, b], [[2, 1], [0, 2]]), ([b, a], [[0, 2], [2, 1]])):
        got = substitute(_scores(*rows), ch, resident=set(), alpha=0.3, rule=WeightRule())
        assert got.chosen.tolist() == ch and got.substituted == 0


def test_replacements_are_independent_of_token_order():
    rng = np.random.default_rng(1)
    s = rng.dirichlet(np.ones(16) * 8, size=40)
    chosen = np.argsort(-s, axis=1)[:, :2]
    resident = {1, 4, 7, 9, 12}
    got = substitute(s, chosen, resident, 0.3, WeightRule())
    perm = rng.permutation(len(s))
    again = substitute(s[perm], chosen[perm], resident, 0.3, WeightRule())
    assert (again.chosen == got.chosen[perm]).all() and got.substituted > 0


def test_weight_rules_per_family():
    sc = np.array([[0.5, 0.3]])
    assert WeightRule(normalise=False).weights(sc)[0].tolist() == pytest.approx([0.5, 0.3])     # qwen2 default
    assert WeightRule(normalise=True, scale=2.5).weights(sc)[0].tolist() == pytest.approx([1.5625, 0.9375])  # dsv3
    with pytest.raises(CoEError, match="alpha"):
        substitute(sc, [[0]], set(), 1.0, WeightRule())


def test_pick_alpha_is_the_smallest_alpha_whose_fitted_time_meets_the_budget():
    from executors.moe_quality import pick_alpha

    alphas, ms = [0.0, 0.1, 0.2, 0.3, 0.4], [50.0, 45.0, 40.0, 35.0, 30.0]     # linear: 50 - 50 alpha
    best, coef = pick_alpha(alphas, ms, 42.0)
    assert best == pytest.approx(0.16, abs=0.005) and len(coef) == 3
    assert pick_alpha(alphas, ms, 60.0)[0] == 0.0            # already within budget: exact
    assert pick_alpha(alphas, ms, 10.0)[0] is None           # no alpha measured gets there
    with pytest.raises(ValueError):
        pick_alpha([0.0], [1.0], 1.0)


def test_the_top_score_set_is_what_substitution_always_keeps():
    from routing.substitution import top_score

    scores = np.array([[0.5, 0.3, 0.2], [0.36, 0.34, 0.30], [0.2, 0.45, 0.35]])
    chosen = np.array([[0], [0], [2]])            # S = the 2nd score; top-score: s > 1.3 x S
    # token 0's expert 0 (0.5 > 0.39) is top-score; token 1's 0.36 is low-score (<= 0.442); token 2 chose 2
    # (0.35), not its top: at its S, so never low-score, never replaced, loaded if missing (kept)
    assert top_score(scores, chosen, 0.3) == {0, 2}
    assert top_score(scores, chosen, 0.0) == {0, 2}
    assert top_score(scores[:, :1], chosen[:, :1] * 0, 0.3) == {0}     # k >= E: every chosen expert
    rule = WeightRule()
    sub = substitute(scores[1:2], chosen[1:2], resident={1}, alpha=0.3, rule=rule)
    assert sub.substituted == 1 and 0 not in top_score(scores[1:2], chosen[1:2], 0.3)   # low-score: replaced
    kept = substitute(scores[2:3], chosen[2:3], resident={0, 1}, alpha=0.3, rule=rule)
    assert kept.substituted == 0 and kept.chosen.tolist() == [[2]]    # what top_score says is kept, is kept


def test_a_routers_padding_index_is_left_alone_not_read_as_an_expert():
    """An index past the experts (or -1) is a router's padding (`RouterTap._check` lets it through): a token that
    has one is left as the router gave it; -1 used to read the last expert's score, E to raise IndexError."""
    from routing.substitution import top_score

    scores = np.array([[.4, .3, .2, .1], [.4, .3, .2, .1]])
    for pad in (4, -1):
        chosen = np.array([[0, 1], [0, pad]])
        got = substitute(scores, chosen, {0, 2}, 0.5, WeightRule())
        assert got.chosen[1].tolist() == [0, pad] and not got.changed[1]
        assert got.chosen[0].tolist() == [0, 2] and got.changed[0]      # the other token is served as always
        assert pad not in top_score(scores, chosen, 0.5)


def test_a_biased_grouped_router_substitutes_only_experts_it_could_have_picked():
    """DeepSeek-V3 picks on sigmoid + a correction bias within its best groups: S is the gate score of its own
    (k+1)-th pick, and a substitute from a group it did not select (or one the bias excluded) is not one."""
    scores = np.array([[.9, .5, .55, .3, .45, .52, .1, .1]])
    bias = np.array([0, 0, 0, 0, -.3, -.3, 0, 0])
    rank = scores + bias
    rank[0, 4:] = -np.inf                            # groups of two: the router kept groups 0 and 1 only
    chosen = np.array([[0, 2, 1]])
    plain = substitute(scores, chosen, {0, 1, 4}, 0.3, WeightRule())
    assert plain.chosen.tolist() == [[0, 4, 1]]      # gate scores alone: S = 0.5, expert 4 from an unpicked group
    got = substitute(scores, chosen, {0, 1, 4}, 0.3, WeightRule(), rank=rank)
    assert got.chosen.tolist() == [[0, 2, 1]] and got.substituted == 0   # S = 0.30 (expert 3): all top-score
    # a token whose router could pick only its k experts has no (k+1)-th, so no band.  Read off an expert it could
    # not pick (S = 0.1 here), its whole choice would count as top-score, and that would keep the other token's
    # missing low-score expert 2 from being substituted
    two = np.array([[.9, .5, .55, .1, .1, .1, .1, .1], [.9, .5, .55, .48, .1, .1, .1, .1]])
    r2 = np.full_like(two, -np.inf)
    r2[0, :3] = two[0, :3]                          # token 0: three experts it could pick, all chosen
    r2[1, :4] = two[1, :4]                          # token 1: S = 0.48 (expert 3); experts 2 and 1 low-score
    got2 = substitute(two, [[0, 2, 1], [0, 2, 1]], {0, 1, 3}, 0.3, WeightRule(), rank=r2)
    assert got2.chosen.tolist() == [[0, 2, 1], [0, 3, 1]] and got2.substituted == 1
    near = np.array([[.9, .5, .55, .48, .1, .1, .1, .1]])   # S = 0.48 (expert 3): expert 2 (0.55) is low-score
    sub = substitute(near, chosen, {0, 1, 3}, 0.3, WeightRule(), rank=near + 0.0)
    assert sub.chosen.tolist() == [[0, 3, 1]] and sub.substituted == 1
    with pytest.raises(CoEError, match="router ranks of shape"):
        substitute(scores, chosen, set(), 0.3, WeightRule(), rank=rank[:, :4])
