"""Metrics checked against brute-force enumeration of subsets and known values."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo import metrics as M


def brute_best_at_k(scores: list[float], k: int) -> float:
    subsets = list(itertools.combinations(scores, k))
    return float(np.mean([max(s) for s in subsets]))


def brute_pool_best_at_k(chains: np.ndarray, k: int) -> float:
    """Enumerate every ordered draw of ceil(k/m) chains, concatenate, keep the first k answers."""
    n, m = chains.shape
    need = math.ceil(k / m)
    vals = []
    for order in itertools.permutations(range(n), need):
        pool = np.concatenate([chains[j] for j in order])[:k]
        pool = np.where(np.isnan(pool), 0.0, pool)
        vals.append(pool.max())
    return float(np.mean(vals))


def test_pass_at_k_known_values() -> None:
    assert M.pass_at_k(10, 0, 5) == 0.0
    assert M.pass_at_k(10, 10, 1) == 1.0
    assert M.pass_at_k(10, 6, 5) == 1.0  # n - c < k
    assert M.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert M.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert M.pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10), rel=1e-12)
    with pytest.raises(ValueError):
        M.pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        M.pass_at_k(5, 1, 6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=8), st.data())
def test_best_at_k_equals_enumeration(scores: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(scores)))
    assert M.best_at_k(scores, k) == pytest.approx(brute_best_at_k(scores, k), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.data())
def test_best_at_k_on_binary_equals_pass_at_k(bits: list[bool], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(bits)))
    assert M.best_at_k([float(b) for b in bits], k) == pytest.approx(M.pass_at_k(len(bits), sum(bits), k), abs=1e-12)


def test_best_at_k_monotone_in_k_and_bounds() -> None:
    rng = np.random.default_rng(0)
    s = rng.random(30)
    vals = [M.best_at_k(s, k) for k in range(1, 31)]
    assert vals[0] == pytest.approx(s.mean())
    assert vals[-1] == pytest.approx(s.max())
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(vals))
    rows = M.best_at_k(np.stack([s, s[::-1]]), 5)
    np.testing.assert_allclose(rows, [vals[4], vals[4]])
    # large n stays finite and exact-ish (coefficients sum to 1)
    assert M.best_at_k_coefficients(5000, 37).sum() == pytest.approx(1.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(1, 3), st.data())
def test_pool_best_at_k_equals_enumeration(n: int, m: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n * m))
    chains = np.array(data.draw(st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, np.nan]), min_size=m,
                                                            max_size=m), min_size=n, max_size=n)))
    assert M.pool_best_at_k(chains, k) == pytest.approx(brute_pool_best_at_k(chains, k), abs=1e-12)


def test_pool_with_m1_is_best_at_k_and_fair_rollouts() -> None:
    s = np.array([0.1, 0.7, 0.3, 0.9])
    assert M.pool_best_at_k(s[:, None], 2) == pytest.approx(M.best_at_k(s, 2))
    assert [M.fair_num_rollouts(k, 3) for k in (1, 3, 4, 30)] == [1, 1, 2, 10]
    assert M.fair_num_rollouts(5, 1) == 5
    batch = np.stack([np.array([[0.1, 0.5], [0.9, 0.0], [0.2, 0.3]]), np.array([[1.0, 0.0], [0.0, 0.0], [0.5, 0.5]])])
    for k in (1, 2, 3, 5):
        np.testing.assert_allclose(M.pool_best_at_k(batch, k), [M.pool_best_at_k(b, k) for b in batch])
    with pytest.raises(ValueError, match="needs 4 rollouts"):
        M.pool_best_at_k(np.zeros((3, 3)), 10)


def test_expected_weighted_best_at_k() -> None:
    r = np.array([[1.0, 0.0], [0.0, 1.0]])
    w = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    # k=2 picks both answers: max is 1, 1, 0.5
    assert M.expected_weighted_best_at_k(r, 2, weights=w) == pytest.approx((1 + 1 + 0.5) / 3)
    # k=1: average of scalarised values
    assert M.expected_weighted_best_at_k(r, 1, weights=w) == pytest.approx(0.5)
    # Dir(1) on 2 dims: E max(w1, w2) = 3/4
    assert M.expected_weighted_best_at_k(r, 2, num_weights=20000, seed=1) == pytest.approx(0.75, abs=0.01)
    # NaN (absent) dims are ignored
    r_nan = np.array([[1.0, 0.0, np.nan], [0.0, 1.0, np.nan]])
    assert M.expected_weighted_best_at_k(r_nan, 2, num_weights=20000, seed=1) == pytest.approx(0.75, abs=0.01)


def test_reward_diversity_and_pareto_fraction() -> None:
    r = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.2, 0.2]])
    pairs = list(itertools.combinations(range(4), 2))
    expected = np.mean([np.abs(r[i] - r[j]).sum() for i, j in pairs])
    assert M.reward_diversity(r) == pytest.approx(expected)
    assert M.reward_diversity(r[:1]) == 0.0
    assert M.reward_diversity(np.repeat(r[:1], 5, 0)) == 0.0
    assert M.pareto_fraction(r) == pytest.approx(0.75)  # [0.2, 0.2] is dominated by [0.5, 0.5]
    assert M.pareto_fraction(np.repeat(r[:1], 3, 0)) == 1.0  # equal points do not dominate each other


def test_mean_offdiag_correlation() -> None:
    rng = np.random.default_rng(0)
    x = rng.random(200)
    r = np.stack([x, x, 1 - x], 1)
    assert M.mean_offdiag_correlation(r) == pytest.approx((1 - 1 - 1) / 3)
    assert math.isnan(M.mean_offdiag_correlation(np.ones((5, 3))))


def brute_slot_best_at_k(chains: np.ndarray, k: int) -> float:
    """Every k-subset of the flattened n x m answer slots (missing answers score 0)."""
    flat = np.where(np.isnan(chains), 0.0, chains).ravel()
    return float(np.mean([max(sub) for sub in itertools.combinations(flat, k)]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data())
def test_slot_pool_best_at_k_equals_enumeration(n: int, m: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n * m))
    chains = np.array(data.draw(st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, np.nan]), min_size=m,
                                                            max_size=m), min_size=n, max_size=n)))
    assert M.pool_best_at_k(chains, k, pool="slots") == pytest.approx(brute_slot_best_at_k(chains, k), abs=1e-12)
    if m == 1:
        assert M.pool_best_at_k(chains, k, pool="slots") == pytest.approx(M.pool_best_at_k(chains, k), abs=1e-12)


def test_rollout_and_slot_pools_differ_as_the_protocols_say() -> None:
    """10 rollouts of one strong answer followed by two weak ones: at k = 1 our pool takes a whole
    rollout's first answer (the strong one), the authors' a random slot (one in three is strong)."""
    rng = np.random.default_rng(0)
    strong, weak = rng.uniform(0.7, 1.0, 10), rng.uniform(0.0, 0.2, (10, 2))
    chains = np.column_stack([strong, weak])
    assert M.pool_best_at_k(chains, 1) == pytest.approx(strong.mean())
    assert M.pool_best_at_k(chains, 1, pool="slots") == pytest.approx(chains.mean())
    assert M.pool_best_at_k(chains, 3) == pytest.approx(strong.mean())  # one whole rollout
    assert M.pool_best_at_k(chains, 3, pool="slots") < strong.mean()  # three slots can miss every strong one
    batch = np.stack([chains, chains[::-1]])
    np.testing.assert_allclose(M.pool_best_at_k(batch, 4, pool="slots"), [M.pool_best_at_k(chains, 4, pool="slots")] * 2)
    with pytest.raises(ValueError, match="pool must be one of"):
        M.pool_best_at_k(chains, 1, pool="chains")
    with pytest.raises(ValueError, match="n\\*m = 30"):
        M.pool_best_at_k(chains, 31, pool="slots")


def test_hedge_values_and_greedy_curve_by_hand() -> None:
    """Two outcomes, equally likely: a safe candidate (0.6 either way) and two that each win one outcome.
    One answer: the safe one (0.6); two: both specialists (1.0), which the greedy curve, starting
    from the safe answer, reaches only at three."""
    scal = np.array([[0.6, 0.6], [1.0, 0.0], [0.0, 1.0]])
    probs = np.array([0.5, 0.5])
    assert M.hedge_values(scal, probs, 3) == [0.6, 1.0, 1.0]
    assert M.greedy_hedge_curve(scal, probs, 3) == [0.6, 0.8, 1.0]
    with pytest.raises(ValueError, match="k_max must be 1, 2 or 3"):
        M.hedge_values(scal, probs, 4)
    with pytest.raises(ValueError, match="k_max must be >= 1"):
        M.greedy_hedge_curve(scal, probs, 0)
