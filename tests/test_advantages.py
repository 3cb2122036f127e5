"""Estimators against their definitions: loop references, hand-computed values, invariants."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo import advantages as A
from vpo import reference as R
from vpo.metrics import best_at_k


def _random_sets(rng: np.random.Generator, n_groups: int, g: int, m: int, d: int, *, ragged: bool = True,
                 nan_dims: bool = True) -> tuple[list[np.ndarray], list[int]]:
    sets, gids = [], []
    for grp in range(n_groups):
        absent = rng.random(d) < 0.3 if nan_dims else np.zeros(d, dtype=bool)
        absent[0] = False
        for _ in range(g):
            mi = int(rng.integers(0, m + 1)) if ragged else m
            mat = rng.random((mi, d)).round(2)
            mat[:, absent] = np.nan
            sets.append(mat)
            gids.append(grp)
    return sets, gids


def test_vpo_matches_loop_reference_with_given_weights() -> None:
    rng = np.random.default_rng(0)
    sets, gids = _random_sets(rng, n_groups=6, g=5, m=3, d=4)
    w = rng.dirichlet(np.ones(4), size=50)
    got = A.vpo_advantage(sets, gids, weights=w).numpy()
    ref = R.vpo_advantage_loop(sets, gids, {g: w for g in set(gids)})
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


def test_vpo_matches_loop_reference_with_sampled_weights() -> None:
    """Sampled weights: recreate the draws with the same generator seed and feed the loop."""
    rng = np.random.default_rng(1)
    sets, gids = _random_sets(rng, n_groups=4, g=8, m=3, d=5)
    got = A.vpo_advantage(sets, gids, num_weights=30, generator=torch.Generator().manual_seed(7)).numpy()
    w = A.sample_weights(4, 30, 5, generator=torch.Generator().manual_seed(7)).numpy()
    ref = R.vpo_advantage_loop(sets, gids, {g: w[g] for g in range(4)})
    np.testing.assert_allclose(got, ref, atol=1e-12)


def test_hand_computed_vpo_example() -> None:
    """Two complementary single answers and an empty rollout, one weight [1, 0] and one [0, 1]."""
    sets = [np.array([[1.0, 0.0]]), np.array([[0.0, 1.0], [1.0, 0.0]]), np.zeros((0, 2))]
    w = np.array([[1.0, 0.0], [0.0, 1.0]])
    adv = A.vpo_advantage(sets, [0, 0, 0], weights=w).numpy()
    scores = np.array([0.5, 1.0, 0.0])
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    np.testing.assert_allclose(adv, expected, atol=1e-12)


@pytest.mark.parametrize("n_per_group", [2, 5, 8])
def test_d1_m1_vpo_equals_population_std_grpo_exactly(n_per_group: int) -> None:
    """The d = 1, m = 1 identity, stated against the std VPO uses (population, as the authors)."""
    rng = np.random.default_rng(n_per_group)
    scores = rng.random(4 * n_per_group)
    sets = [np.array([[s]]) for s in scores]
    gids = np.repeat(np.arange(4), n_per_group)
    vpo = A.vpo_advantage(sets, gids, generator=torch.Generator().manual_seed(0))
    grpo = A.grpo_population_std_advantage(sets, gids)
    assert torch.equal(vpo, grpo)
    # and that GRPO is the textbook population z-score
    ref = R.grpo_population_std_advantage_loop(sets, list(gids))
    np.testing.assert_allclose(grpo.numpy(), ref, atol=1e-12)
    # TRL's grpo divides the same centred score by the sample std + 1e-4, so VPO's advantages are
    # larger by sqrt(n / (n - 1)) wherever the std dwarfs the eps terms
    trl = A.grpo_advantage(sets, gids).numpy()
    groups = scores.reshape(4, n_per_group)
    pop, sample = np.repeat(groups.std(1), n_per_group), np.repeat(groups.std(1, ddof=1), n_per_group)
    np.testing.assert_allclose(vpo.numpy() * (pop + 1e-6), trl * (sample + 1e-4), atol=1e-6)
    wide = sample > 0.1
    np.testing.assert_allclose(vpo.numpy()[wide], trl[wide] * np.sqrt(n_per_group / (n_per_group - 1)), rtol=2e-3)
    assert wide.any() and not np.allclose(vpo.numpy(), trl, rtol=1e-2)


def test_d1_m1_equality_holds_for_sobol_and_any_alpha() -> None:
    sets = [np.array([[v]]) for v in [0.1, 0.5, 0.9, 0.3]]
    for sampler in ("dirichlet", "sobol"):
        for alpha in (0.5, 1.0, 3.0):
            vpo = A.vpo_advantage(sets, [0, 0, 1, 1], sampler=sampler, alpha=alpha,
                                  generator=torch.Generator().manual_seed(3))
            assert torch.equal(vpo, A.grpo_population_std_advantage(sets, [0, 0, 1, 1]))


def test_zero_variance_group_gets_zero_and_other_groups_unaffected() -> None:
    sets = [np.array([[0.5, 0.5]])] * 3 + [np.array([[1.0, 0.0]]), np.array([[0.0, 0.0]]), np.array([[0.2, 0.0]])]
    gids = [0, 0, 0, 1, 1, 1]
    goal = np.tile([0.5, 0.5], (6, 1))
    for name, fn in A.ESTIMATORS.items():
        adv = fn(sets, gids, generator=torch.Generator().manual_seed(0), weights=goal if name == "goal_conditioned_grpo"
                 else None)
        if name == "gdpo":  # its batch-wide z-score centres a mean that is 0 only up to rounding
            assert torch.all(adv[:3].abs() < 1e-12), name
        else:
            assert torch.all(adv[:3] == 0), name
        if name == "grpo_passk":  # only the best rollout of a group moves
            assert adv[3] > 0 and adv[4] == adv[5] == 0, name
        else:
            assert adv[3] > 0 > adv[4], name


def test_empty_rollouts_score_zero() -> None:
    sets = [np.zeros((0, 3)), np.array([[0.2, 0.2, 0.2]]), np.zeros((0, 3))]
    for name in ("vpo", "grpo", "grpo_population_std", "multi_rlvr", "random_weight_grpo",
                 "random_weight_grpo_per_rollout", "max_at_k"):
        adv = A.get_estimator(name)(sets, [0, 0, 0], generator=torch.Generator().manual_seed(0), k=1)
        assert adv[1] > 0 and adv[0] == adv[2] < 0, name
    # a group of only empty rollouts has zero advantage
    adv = A.vpo_advantage([np.zeros((0, 2))] * 3, [0, 0, 0])
    assert torch.all(adv == 0)


def test_nan_dimension_is_ignored_not_zeroed() -> None:
    """A problem with 2 of 3 tests: adding an absent third dim must not change any estimator."""
    rng = np.random.default_rng(5)
    base = [rng.random((int(rng.integers(1, 4)), 2)) for _ in range(6)]
    with_nan = [np.concatenate([b, np.full((b.shape[0], 1), np.nan)], axis=1) for b in base]
    gids = [0, 0, 0, 1, 1, 1]
    w2 = rng.dirichlet(np.ones(2), size=20)
    w3 = np.concatenate([w2 * 0.7, np.full((20, 1), 0.3)], axis=1)  # absent dim's weight is dropped
    np.testing.assert_allclose(A.vpo_advantage(base, gids, weights=w2), A.vpo_advantage(with_nan, gids, weights=w3),
                               atol=1e-12)
    for name in ("grpo", "grpo_population_std", "gdpo", "multi_rlvr", "maxrl", "max_at_k", "grpo_passk"):
        fn = A.get_estimator(name)
        np.testing.assert_allclose(fn(base, gids, k=2), fn(with_nan, gids, k=2), atol=1e-6, err_msg=name)
    # treating NaN as a real 0 would differ: random weight mass on the dead dimension varies per draw
    zeroed = [np.nan_to_num(x) for x in with_nan]
    gen = lambda: torch.Generator().manual_seed(4)
    assert not np.allclose(A.vpo_advantage(zeroed, gids, generator=gen()), A.vpo_advantage(with_nan, gids, generator=gen()))


def test_determinism_with_equal_generators_and_difference_otherwise() -> None:
    rng = np.random.default_rng(2)
    sets, gids = _random_sets(rng, n_groups=5, g=6, m=3, d=6)
    for name in ("vpo", "random_weight_grpo_per_rollout"):
        fn = A.get_estimator(name)
        for sampler in ("dirichlet", "sobol"):
            a = fn(sets, gids, sampler=sampler, generator=torch.Generator().manual_seed(11))
            b = fn(sets, gids, sampler=sampler, generator=torch.Generator().manual_seed(11))
            c = fn(sets, gids, sampler=sampler, generator=torch.Generator().manual_seed(12))
            assert torch.equal(a, b), (name, sampler)
            assert not torch.equal(a, c), (name, sampler)


def test_weights_shared_within_group_fresh_across_groups() -> None:
    """Two identical groups get different weight draws; identical rollouts in one group tie."""
    sets = [np.array([[1.0, 0.0, 0.0]]), np.array([[0.0, 1.0, 0.0]]), np.array([[0.0, 0.0, 1.0]])] * 2
    gids = [0, 0, 0, 1, 1, 1]
    adv = A.vpo_advantage(sets, gids, num_weights=5, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(adv[:3], adv[3:])
    w = A.sample_weights(2, 5, 3, generator=torch.Generator().manual_seed(0))
    assert w.shape == (2, 5, 3)
    np.testing.assert_allclose(w.sum(-1), 1.0)


def test_multi_answer_coverage_beats_single_under_vpo_but_not_multi_rlvr_duplicates() -> None:
    """VPO rewards covering both objectives; a set repeating one answer gains nothing."""
    cover = np.array([[1.0, 0.0], [0.0, 1.0]])
    single = np.array([[1.0, 0.0]])
    adv = A.vpo_advantage([cover, single], [0, 0], generator=torch.Generator().manual_seed(0))
    assert adv[0] > 0 > adv[1]
    ref = R.multi_rlvr_advantage_loop([cover, single], [0, 0])
    np.testing.assert_allclose(A.multi_rlvr_advantage([cover, single], [0, 0]).numpy(), ref, atol=1e-12)


def test_gdpo_and_multi_rlvr_match_loops() -> None:
    rng = np.random.default_rng(9)
    sets, gids = _random_sets(rng, n_groups=5, g=4, m=3, d=3)
    w_star = np.array([0.2, 0.3, 0.5])
    for fn, ref in ((A.gdpo_advantage, R.gdpo_advantage_loop), (A.multi_rlvr_advantage, R.multi_rlvr_advantage_loop),
                    (A.grpo_population_std_advantage, R.grpo_population_std_advantage_loop),
                    (A.maxrl_advantage, R.maxrl_advantage_loop)):
        np.testing.assert_allclose(fn(sets, gids, w_star=w_star).numpy(), ref(sets, gids, w_star=w_star), atol=1e-12,
                                   err_msg=fn.__name__)


def test_random_weight_grpo_per_rollout_uses_one_weight_per_rollout() -> None:
    sets = [np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])]
    w = np.array([[1.0, 0.0], [1.0, 0.0]])
    adv = A.random_weight_grpo_per_rollout_advantage(sets, [0, 0], weights=w)
    assert adv[0] > 0 > adv[1]
    w = np.array([[0.0, 1.0], [0.0, 1.0]])
    adv = A.random_weight_grpo_per_rollout_advantage(sets, [0, 0], weights=w)
    assert adv[0] < 0 < adv[1]
    # sampled: a fresh weighting per rollout, population-std z-score of the loop
    rng = np.random.default_rng(4)
    sets, gids = _random_sets(rng, n_groups=3, g=5, m=2, d=4)
    adv = A.random_weight_grpo_per_rollout_advantage(sets, gids, generator=torch.Generator().manual_seed(5))
    w = A.sample_weights(len(sets), 1, 4, generator=torch.Generator().manual_seed(5))[:, 0, :].numpy()
    np.testing.assert_allclose(adv.numpy(), R.weighted_grpo_advantage_loop(sets, gids, w, ddof=0), atol=1e-12)


def test_maxrl_normalises_by_mean() -> None:
    sets = [np.array([[s]]) for s in (0.0, 0.0, 0.0, 1.0)]
    adv = A.maxrl_advantage(sets, [0] * 4).numpy()
    np.testing.assert_allclose(adv, (np.array([0, 0, 0, 1.0]) - 0.25) / (0.25 + 1e-6))


def test_registry_and_errors() -> None:
    assert set(A.ESTIMATORS) == {"vpo", "grpo", "grpo_population_std", "gdpo", "multi_rlvr", "random_weight_grpo",
                                 "random_weight_grpo_per_rollout", "goal_conditioned_grpo", "max_at_k", "grpo_passk",
                                 "maxrl"}
    assert A.get_estimator("VPO") is A.vpo_advantage
    with pytest.raises(KeyError, match="available"):
        A.get_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        A.register_estimator("vpo")(A.grpo_advantage)
    with pytest.raises(ValueError, match="group ids"):
        A.vpo_advantage([np.ones((1, 2))], [0, 1])
    with pytest.raises(ValueError, match="mix dimensionalities"):
        A.vpo_advantage([np.ones((1, 2)), np.ones((1, 3))], [0, 0])
    with pytest.raises(ValueError, match="sampler"):
        A.vpo_advantage([np.ones((1, 2))] * 2, [0, 0], sampler="halton")
    with pytest.raises(ValueError, match="weights must be"):
        A.vpo_advantage([np.ones((1, 2))] * 2, [0, 0], weights=np.ones((3, 4)))
    with pytest.raises(ValueError, match="non-negative; row 1, dimension 0"):
        A.vpo_advantage([np.ones((1, 2))] * 2, [0, 0], weights=np.array([[1.0, 0.0], [-1.0, 2.0]]))
    with pytest.raises(ValueError, match="scale_rewards"):
        A.grpo_advantage([np.ones((1, 2))] * 2, [0, 0], scale_rewards="sometimes")
    with pytest.raises(ValueError, match="aggregation"):
        A.grpo_advantage([np.ones((1, 2))] * 2, [0, 0], aggregation="sum")
    with pytest.raises(ValueError, match="goal_weights"):
        A.goal_conditioned_grpo_advantage([np.ones((1, 2))] * 2, [0, 0])
    with pytest.raises(ValueError, match=r"weights must be \(N, d\) = \(2, 2\)"):
        A.goal_conditioned_grpo_advantage([np.ones((1, 2))] * 2, [0, 0], weights=np.ones((3, 2)))
    with pytest.raises(ValueError, match="1 <= k <= n - 1; got k=2 for groups of n=2"):
        A.max_at_k_advantage([np.ones((1, 2))] * 2, [0, 0])  # the default k = max(2, n // 2) needs n >= 3
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        A.grpo_passk_advantage([np.ones((1, 2))] * 3, [0, 0, 1])
    with pytest.raises(ValueError, match="prompt ids"):
        A.random_weight_grpo_advantage([np.ones((1, 2))] * 2, [0, 0], prompt_ids=["a"])


def test_sobol_has_lower_variance_than_iid_for_small_k() -> None:
    """The quasi-Monte-Carlo sampler's reason to exist: less advantage noise at the same K."""
    sets = [np.array([[1.0, 0.0, 0.3]]), np.array([[0.0, 1.0, 0.3]]), np.array([[0.4, 0.4, 0.4]])]
    exact = A.vpo_advantage(sets, [0, 0, 0], num_weights=20000, generator=torch.Generator().manual_seed(0))
    errs = {}
    for sampler in ("dirichlet", "sobol"):
        e = [((A.vpo_advantage(sets, [0, 0, 0], num_weights=32, sampler=sampler,
                                generator=torch.Generator().manual_seed(s)) - exact) ** 2).sum().item()
             for s in range(60)]
        errs[sampler] = float(np.mean(e))
    assert errs["sobol"] < errs["dirichlet"]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 6), st.integers(1, 3), st.integers(1, 5), st.integers(0, 10_000))
def test_property_vectorised_equals_loop_and_group_invariants(n_groups: int, g: int, m: int, d: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sets, gids = _random_sets(rng, n_groups, g, m, d)
    w = rng.dirichlet(np.ones(d), size=7)
    adv = A.vpo_advantage(sets, gids, weights=w).numpy()
    np.testing.assert_allclose(adv, R.vpo_advantage_loop(sets, gids, {k: w for k in set(gids)}), atol=1e-9)
    gids_arr = np.asarray(gids)
    for grp in range(n_groups):
        a = adv[gids_arr == grp]
        assert abs(a.mean()) < 1e-9  # z-scores are centred in each group
        assert np.all(np.abs(a) <= np.sqrt(g - 1) + 1e-6)  # bound on a population z-score
    # permuting rollouts permutes advantages (weights given => no sampling-order effects)
    perm = rng.permutation(len(sets))
    adv_p = A.vpo_advantage([sets[i] for i in perm], [gids[i] for i in perm], weights=w).numpy()
    np.testing.assert_allclose(adv_p, adv[perm], atol=1e-9)


def test_accepts_padded_tensor_input() -> None:
    t = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]]])
    adv = A.vpo_advantage(t, [0, 0], weights=np.array([[1.0, 0.0], [0.0, 1.0]]))
    assert adv[0] > 0 > adv[1]


# -- fast path -------------------------------------------------------------------------------------
def test_vpo_fast_path_matches_loop_on_every_layout() -> None:
    """Contiguous groups, shuffled groups, negative rewards (masked max) and junk in padding rows."""
    rng = np.random.default_rng(21)
    sets, gids = _random_sets(rng, n_groups=5, g=4, m=3, d=4)
    w = rng.dirichlet(np.ones(4), size=9)
    ref = R.vpo_advantage_loop(sets, gids, {g: w for g in set(gids)})
    np.testing.assert_allclose(A.vpo_advantage(sets, gids, weights=w).numpy(), ref, atol=1e-12)
    perm = rng.permutation(len(sets))
    shuffled = A.vpo_advantage([sets[i] for i in perm], [gids[i] for i in perm], weights=w).numpy()
    np.testing.assert_allclose(shuffled, ref[perm], atol=1e-12)
    negative = [s - 0.7 for s in sets]  # an answer may now score below an absent one
    ref_neg = R.vpo_advantage_loop(negative, gids, {g: w for g in set(gids)})
    np.testing.assert_allclose(A.vpo_advantage(negative, gids, weights=w).numpy(), ref_neg, atol=1e-12)
    batch = A.as_reward_batch(sets)
    junk = A.RewardBatch(torch.where(batch.rows[:, :, None], batch.values, torch.tensor(5.0, dtype=torch.float64)),
                         batch.rows)
    np.testing.assert_allclose(A.vpo_advantage(junk, gids, weights=w).numpy(), ref, atol=1e-12)


def test_group_index_fast_path_keeps_first_seen_order() -> None:
    ids = [7, 3, 7, 9, 3, 3]
    gidx, n = A.group_index(np.array(ids))
    assert n == 3 and gidx.tolist() == [0, 1, 0, 2, 1, 1]
    assert A.group_index(ids)[0].tolist() == gidx.tolist() == A.group_index([str(i) for i in ids])[0].tolist()
    assert A.group_index(torch.tensor(ids))[0].tolist() == gidx.tolist()


# -- Dirichlet sampling ----------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["dirichlet", "sobol"])
@pytest.mark.parametrize("alpha", [1e-3, 1e-5, 1e-9, 1e-40])
def test_sample_weights_never_nan_for_tiny_alpha(sampler: str, alpha: float) -> None:
    present = np.ones((64, 5), dtype=bool)
    present[::2, 3:] = False
    for mask in (None, present):
        w = A.sample_weights(64, 50, 5, alpha=alpha, sampler=sampler, generator=torch.Generator().manual_seed(0),
                             present=mask).numpy()
        assert np.isfinite(w).all()
        np.testing.assert_allclose(w.sum(-1), 1.0)
        if mask is not None:
            assert (w.transpose(0, 2, 1)[~mask] == 0).all()
        # Dir(alpha -> 0) puts (almost) all mass on one dimension, each equally likely
        assert np.mean(w.max(-1) > 0.99) > 0.95
    top = w[1::2].argmax(-1).ravel()  # rows with all 5 dims present
    assert np.bincount(top, minlength=5).min() > 0.1 * top.size
    adv = A.vpo_advantage([np.eye(5)[:3], np.eye(5)[3:]] * 3, [0, 0, 1, 1, 2, 2], alpha=alpha, sampler=sampler,
                          generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("alpha", [0.3, 1.0, 3.0])
def test_sample_weights_have_dirichlet_moments(alpha: float) -> None:
    """E[w_j] = 1/d and Var[w_j] = (d - 1) / (d^2 (d alpha + 1)) for Dir(alpha) on d dims."""
    d = 4
    w = A.sample_weights(500, 200, d, alpha=alpha, generator=torch.Generator().manual_seed(2)).numpy().reshape(-1, d)
    var = (d - 1) / (d**2 * (d * alpha + 1))
    np.testing.assert_allclose(w.mean(0), 1 / d, atol=5 * np.sqrt(var / len(w)))
    np.testing.assert_allclose(w.var(0), var, rtol=0.02)


def test_prompt_weights_fixed_by_seed_and_prompt() -> None:
    a = A.prompt_weights(["p1", "p2", "p1"], 3, seed=4)
    np.testing.assert_array_equal(a[0], a[2])
    assert not np.allclose(a[0], a[1])
    np.testing.assert_array_equal(a, A.prompt_weights(["p1", "p2", "p1"], 3, seed=4))
    assert not np.allclose(a, A.prompt_weights(["p1", "p2", "p1"], 3, seed=5))
    np.testing.assert_array_equal(A.prompt_weights([3], 3, seed=4), A.prompt_weights(["3"], 3, seed=4))
    np.testing.assert_allclose(a.sum(1), 1.0)
    tiny = A.prompt_weights([f"q{i}" for i in range(200)], 4, seed=0, alpha=1e-6,
                            present=np.tile([True, True, False, True], (200, 1)))
    assert np.isfinite(tiny).all() and (tiny[:, 2] == 0).all()
    np.testing.assert_allclose(tiny.sum(1), 1.0)
    with pytest.raises(ValueError, match="no present dimension"):
        A.prompt_weights(["a"], 2, present=np.zeros((1, 2), dtype=bool))
    with pytest.raises(ValueError, match="seed"):
        A.prompt_weights(["a"], 2, seed=-1)


# -- TRL's GRPO ------------------------------------------------------------------------------------
def test_nanstd_is_trl_nanstd_bit_for_bit() -> None:
    trl_utils = pytest.importorskip("trl.trainer.utils")
    x = torch.tensor(np.random.default_rng(0).random((6, 5)), dtype=torch.float32)
    x[0, 1] = x[2, :4] = x[3, :] = float("nan")
    for dim, keepdim in ((None, False), (1, False), (0, True), (1, True)):
        ours, theirs = A._nanstd(x, dim=dim, keepdim=keepdim), trl_utils.nanstd(x, dim=dim, keepdim=keepdim)
        assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num())


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_matches_trl_formula_loop(scale_rewards: str, aggregation: str) -> None:
    rng = np.random.default_rng(len(scale_rewards) * 10 + len(aggregation))
    sets, gids = _random_sets(rng, n_groups=5, g=6, m=1, d=3)
    sets[0] = np.full((1, 3), np.nan)  # a real answer with every column absent: TRL's "unscorable" row
    sets[1] = np.array([[0.3, 0.4, 0.5]])
    sets[7] = np.zeros((0, 3))  # an empty rollout scores 0 on its group's present dims
    w = np.array([0.2, 0.5, 0.3])
    for w_star in (None, w):
        got = A.grpo_advantage(sets, gids, w_star=w_star, scale_rewards=scale_rewards, aggregation=aggregation)
        ref = R.trl_grpo_advantage_loop(sets, gids, w_star=w_star, scale_rewards=scale_rewards,
                                        aggregation=aggregation)
        np.testing.assert_allclose(got.numpy(), ref, atol=2e-5)  # TRL computes in float32
        assert got[0] == 0
    perm = rng.permutation(len(sets))  # groups need not be contiguous
    shuffled = A.grpo_advantage([sets[i] for i in perm], [gids[i] for i in perm], scale_rewards=scale_rewards,
                                aggregation=aggregation)
    np.testing.assert_allclose(shuffled.numpy(), A.grpo_advantage(sets, gids, scale_rewards=scale_rewards,
                                                                   aggregation=aggregation).numpy()[perm], atol=1e-6)


def test_grpo_hand_example_in_float32() -> None:
    """One success in four: (1 - 0.25) / (sample std 0.5 + 1e-4), computed in float32 as TRL."""
    adv = A.grpo_advantage([np.array([[v]]) for v in (1.0, 0.0, 0.0, 0.0)], [0] * 4)
    std = np.sqrt(np.float32(0.1875) * np.float32(4 / 3))  # nanmean of squares, Bessel in float32
    expected = (np.float32([1, 0, 0, 0]) - np.float32(0.25)) / (std + np.float32(1e-4))
    assert adv.tolist() == expected.astype(np.float64).tolist()


# -- Max@k -----------------------------------------------------------------------------------------
def _subset_enumeration(r: list[float], k: int) -> list[float]:
    subsets = list(itertools.combinations(range(len(r)), k))
    return [sum(max(r[j] for j in s) for s in subsets if i in s) / len(subsets) for i in range(len(r))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 0.7]), min_size=1, max_size=7), st.data())
def test_max_at_k_scores_equal_subset_enumeration(r: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(r)))
    got = A.max_at_k_scores(r, k).numpy()
    np.testing.assert_allclose(got, _subset_enumeration(r, k), atol=1e-12)
    assert got.sum() == pytest.approx(k * best_at_k(r, k), abs=1e-12)  # sum_i s_i = k * unbiased best@k


@pytest.mark.parametrize(("n", "k"), [(2, 1), (3, 2), (4, 2), (4, 3), (4, 4)])
def test_max_at_k_is_an_unbiased_gradient_of_max_at_k(n: int, k: int) -> None:
    """A softmax policy over 3 outcomes: E over all n-tuples of sum_i s_i grad log p(y_i) equals
    the exact gradient of E[max of k iid samples] (both by enumeration)."""
    values = torch.tensor([0.2, 1.0, 0.5], dtype=torch.float64)
    logits = torch.tensor([0.3, -0.4, 0.1], dtype=torch.float64, requires_grad=True)
    p = torch.softmax(logits, 0)
    objective = sum(torch.prod(p[list(t)]) * values[list(t)].max() for t in itertools.product(range(3), repeat=k))
    (exact,) = torch.autograd.grad(objective, logits)
    p = p.detach()
    estimate = torch.zeros(3, dtype=torch.float64)
    for t in itertools.product(range(3), repeat=n):
        s = A.max_at_k_scores(values[list(t)], k)
        score = sum(s[i] * (torch.eye(3, dtype=torch.float64)[y] - p) for i, y in enumerate(t))
        estimate += torch.prod(p[list(t)]) * score
    torch.testing.assert_close(estimate, exact, atol=1e-12, rtol=0)


def test_max_at_k_matches_paper_formula_loop() -> None:
    rng = np.random.default_rng(11)
    for g, k in ((8, None), (8, 3), (5, 1), (6, 5)):
        sets, gids = _random_sets(rng, n_groups=4, g=g, m=2, d=3)
        got = A.max_at_k_advantage(sets, gids, k=k).numpy()
        np.testing.assert_allclose(got, R.max_at_k_advantage_loop(sets, gids, k=k), atol=1e-12)
    # the authors' default k = max(2, n // 2): 4 for n = 8
    np.testing.assert_array_equal(A.max_at_k_advantage(sets, gids).numpy(), A.max_at_k_advantage(sets, gids, k=3).numpy())
    sets, gids = _random_sets(rng, n_groups=3, g=8, m=1, d=2)
    np.testing.assert_array_equal(A.max_at_k_advantage(sets, gids).numpy(), A.max_at_k_advantage(sets, gids, k=4).numpy())
    assert not np.allclose(A.max_at_k_advantage(sets, gids).numpy(), A.max_at_k_advantage(sets, gids, k=2).numpy())


# -- grpo_passk ------------------------------------------------------------------------------------
def test_grpo_passk_only_the_best_rollout_moves() -> None:
    sets = [np.array([[v]]) for v in (0.2, 0.9, 0.5, 0.1)]
    adv = A.grpo_passk_advantage(sets, [0] * 4).numpy()
    expected = (0.9 - 0.5) / (np.std([0.2, 0.9, 0.5, 0.1], ddof=1) + 1e-6)
    np.testing.assert_allclose(adv, [0, expected, 0, 0], atol=1e-12)
    tie = A.grpo_passk_advantage([np.array([[v]]) for v in (0.9, 0.2, 0.9)], [0] * 3)
    assert torch.all(tie == 0)
    rng = np.random.default_rng(6)
    sets, gids = _random_sets(rng, n_groups=5, g=6, m=2, d=3)
    np.testing.assert_allclose(A.grpo_passk_advantage(sets, gids).numpy(), R.grpo_passk_advantage_loop(sets, gids),
                               atol=1e-12)


# -- random-weight and goal-conditioned GRPO -------------------------------------------------------
def test_random_weight_grpo_is_per_prompt_fixed_across_epochs() -> None:
    rng = np.random.default_rng(8)
    sets, gids = _random_sets(rng, n_groups=4, g=5, m=1, d=3)
    ids = [f"prompt-{g}" for g in gids]
    adv = A.random_weight_grpo_advantage(sets, gids, prompt_ids=ids, seed=3)
    w = A.prompt_weights(ids, 3, seed=3)
    np.testing.assert_allclose(adv.numpy(), R.weighted_grpo_advantage_loop(sets, gids, w, ddof=1), atol=1e-12)
    # one weighting per prompt, shared by its rollouts; the step's generator plays no part
    assert all(np.array_equal(w[i], w[j]) for i in range(len(ids)) for j in range(len(ids)) if ids[i] == ids[j])
    again = A.random_weight_grpo_advantage(sets, gids, prompt_ids=ids, seed=3, generator=torch.Generator().manual_seed(9))
    assert torch.equal(adv, again)
    # the same prompt in a later batch, at another position and group index, gets the same weighting
    later = A.random_weight_grpo_advantage(sets[10:] + sets[:10], [9 - g for g in gids[10:] + gids[:10]],
                                           prompt_ids=ids[10:] + ids[:10], seed=3)
    np.testing.assert_allclose(later.numpy(), np.concatenate([adv.numpy()[10:], adv.numpy()[:10]]), atol=1e-12)
    assert not torch.allclose(adv, A.random_weight_grpo_advantage(sets, gids, prompt_ids=ids, seed=4))
    # without prompt ids the group ids name the prompts
    assert torch.equal(A.random_weight_grpo_advantage(sets, ids, seed=3), adv)


def test_goal_conditioned_grpo_scores_the_weighting_each_prompt_shows() -> None:
    rng = np.random.default_rng(12)
    sets, gids = _random_sets(rng, n_groups=3, g=4, m=1, d=3)
    w = rng.dirichlet(np.ones(3), size=len(sets))
    adv = A.goal_conditioned_grpo_advantage(sets, gids, weights=w)
    np.testing.assert_allclose(adv.numpy(), R.weighted_grpo_advantage_loop(sets, gids, w, ddof=1), atol=1e-12)
    flipped = A.goal_conditioned_grpo_advantage([np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])], [0, 0],
                                                weights=[[0.1, 0.9], [0.1, 0.9]])
    assert flipped[0] < 0 < flipped[1]


def test_goal_condition_rows_writes_the_same_weights_into_prompt_and_column() -> None:
    rows = [{"id": "a", "prompt": "Route the maze."}, {"id": "b", "prompt": [{"role": "system", "content": "S"},
                                                                            {"role": "user", "content": "Q?"}]},
            {"id": "c", "prompt": "Third.", "n_dims": 2}]
    names = ("gold", "diamond", "speed")
    out = A.goal_condition_rows(rows, names, seed=7, present=lambda r: np.arange(3) < r.get("n_dims", 3))
    w = A.prompt_weights(["a", "b", "c"], 3, seed=7, present=np.array([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=bool))
    for row, wi in zip(out, w):
        assert row[A.GOAL_WEIGHTS_COLUMN] == wi.tolist()
    assert out[0]["prompt"].startswith("Route the maze.\n\n") and f"- gold: {w[0, 0]:.2f}" in out[0]["prompt"]
    assert out[1]["prompt"][0] == rows[1]["prompt"][0]  # the system message is untouched
    assert f"- speed: {w[1, 2]:.2f}" in out[1]["prompt"][1]["content"] and rows[1]["prompt"][1]["content"] == "Q?"
    assert "speed" not in out[2]["prompt"] and out[2][A.GOAL_WEIGHTS_COLUMN][2] == 0.0
    assert out[2]["n_dims"] == 2 and "goal_weights" not in rows[0]  # other columns kept, input not mutated
    # the column is what the estimator scores with
    sets = [np.array([[1.0, 0.0, 0.0]]), np.array([[0.0, 1.0, 0.0]]), np.array([[0.0, 0.0, 1.0]])]
    adv = A.goal_conditioned_grpo_advantage(sets, [0, 0, 0], weights=[r[A.GOAL_WEIGHTS_COLUMN] for r in out])
    np.testing.assert_allclose(adv.numpy(), R.weighted_grpo_advantage_loop(sets, [0, 0, 0], w, ddof=1), atol=1e-12)
    with pytest.raises(KeyError, match="row 0 has no 'id'"):
        A.goal_condition_rows([{"prompt": "x"}], names, seed=0)
    with pytest.raises(ValueError, match="no user message"):
        A.goal_prompt([{"role": "system", "content": "S"}], [1.0, 0, 0], names)
