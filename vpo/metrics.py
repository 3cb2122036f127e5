"""Test-time search metrics: unbiased pass@k and best@k, E_w[best@k], diversity, Pareto fraction,
and fair pools for multi-answer methods (VPO_SPEC section 2).

All estimators are exact expectations over subsets drawn without replacement, so they agree with
brute-force enumeration for small n (see tests) and carry no Monte-Carlo noise of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "POOLS",
    "best_at_k",
    "best_at_k_coefficients",
    "dirichlet_weights",
    "expected_weighted_best_at_k",
    "fair_num_rollouts",
    "greedy_hedge_curve",
    "hedge_values",
    "mean_offdiag_correlation",
    "pareto_fraction",
    "pass_at_k",
    "pool_best_at_k",
    "reward_diversity",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k)/C(n, k) (Chen et al. 2021), in the stable product form."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def best_at_k_coefficients(n: int, k: int) -> np.ndarray:
    """Weights c_i (i = 1..n, ascending order) with E[max of k of n] = sum_i c_i r_(i).

    c_i = C(i-1, k-1) / C(n, k); computed by the ratio c_{i-1} = c_i (i-k)/(i-1) from c_n = k/n.
    """
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    coef = np.zeros(n, dtype=np.float64)
    coef[n - 1] = k / n
    for i in range(n, k, -1):  # fill c_{i-1} for i = n..k+1 (1-based)
        coef[i - 2] = coef[i - 1] * (i - k) / (i - 1)
    return coef


def best_at_k(scores: Sequence[float] | np.ndarray, k: int) -> float:
    """Unbiased expected max of k scores drawn without replacement from the n given (PKPO's rho).

    On 0/1 scores this equals :func:`pass_at_k`. Works along the last axis for 2-D input,
    returning one value per row (as a float array).
    """
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim == 0 or arr.shape[-1] == 0:
        raise ValueError("best_at_k needs at least one score")
    if np.isnan(arr).any():
        raise ValueError("best_at_k got NaN scores")
    coef = best_at_k_coefficients(arr.shape[-1], k)
    out = np.sort(arr, axis=-1) @ coef
    return float(out) if arr.ndim == 1 else out


def dirichlet_weights(d: int, num: int, alpha: float = 1.0, seed: int = 0) -> np.ndarray:
    """(num, d) weightings w ~ Dir(alpha), seeded (evaluation uses fixed, reproducible draws)."""
    return np.random.default_rng(seed).dirichlet(np.full(d, alpha), size=num)


def _scalarise(rewards: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(K, n) matrix of w_k . r_i with NaN (absent) dims ignored and weights renormalised over the
    dims present in the pool."""
    r = np.asarray(rewards, dtype=np.float64)
    present = ~np.isnan(r).all(axis=0)
    w = np.asarray(weights, dtype=np.float64) * present
    w = w / np.where(w.sum(1, keepdims=True) > 0, w.sum(1, keepdims=True), 1.0)
    return w @ np.nan_to_num(r).T


def expected_weighted_best_at_k(
    rewards: np.ndarray, k: int, *, num_weights: int = 100, alpha: float = 1.0, seed: int = 0,
    weights: np.ndarray | None = None,
) -> float:
    """E over w ~ Dir(alpha) of best@k of w . r for an (n, d) pool of reward vectors."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be (n, d), got shape {r.shape}")
    w = dirichlet_weights(r.shape[1], num_weights, alpha, seed) if weights is None else weights
    return float(np.mean(best_at_k(_scalarise(r, w), k)))


def reward_diversity(rewards: np.ndarray) -> float:
    """Mean pairwise L1 distance between reward vectors (NaN dims ignored); 0 for fewer than 2."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be (n, d), got shape {r.shape}")
    n = r.shape[0]
    if n < 2:
        return 0.0
    diff = np.abs(r[:, None, :] - r[None, :, :])
    dist = np.nansum(diff, axis=-1)
    iu = np.triu_indices(n, 1)
    return float(dist[iu].mean())


def pareto_fraction(rewards: np.ndarray) -> float:
    """Fraction of the pool that no other member dominates (>= on all dims, > on one)."""
    r = np.nan_to_num(np.asarray(rewards, dtype=np.float64), nan=0.0)
    if r.ndim != 2 or r.shape[0] == 0:
        raise ValueError(f"rewards must be a non-empty (n, d) matrix, got shape {r.shape}")
    ge = (r[:, None, :] >= r[None, :, :]).all(-1)
    gt = (r[:, None, :] > r[None, :, :]).any(-1)
    dominated = (ge & gt).any(axis=0)  # column j dominated by some row i
    return float(1.0 - dominated.mean())


def fair_num_rollouts(k: int, m: int) -> int:
    """Rollouts a method with m answers per rollout gets for a budget of k candidates: ceil(k/m)."""
    if k < 1 or m < 1:
        raise ValueError(f"need k >= 1 and m >= 1, got k={k}, m={m}")
    return math.ceil(k / m)


POOLS = ("rollouts", "slots")


def pool_best_at_k(chain_scores: np.ndarray, k: int, *, pool: str = "rollouts") -> float | np.ndarray:
    """Unbiased best@k for a fair pool built from multi-answer chains.

    ``chain_scores`` is (..., n, m): n iid rollouts ("chains") with m answer slots each (NaN or
    -inf = no answer in that slot, scored as the floor 0). ``pool="rollouts"`` (ours, the
    protocol the paper describes): ceil(k/m) chains drawn without replacement with their answers
    concatenated and the first k kept, so every chain contributes all m answers except the last,
    which contributes its first k mod m. ``pool="slots"`` (the authors' evaluation code): k answer
    slots drawn without replacement from the flattened n x m pool. Both are exact expectations
    over the draw, not a permutation sample; with m = 1 both are :func:`best_at_k`. Leading axes
    are batched (one value per leading index).
    """
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    s = np.asarray(chain_scores, dtype=np.float64)
    if s.ndim < 2:
        raise ValueError(f"chain_scores must be (..., n, m), got shape {s.shape}")
    n, m = s.shape[-2:]
    full_chains, rest = divmod(k, m)
    need = full_chains + (1 if rest else 0)
    if pool == "rollouts" and need > n:
        raise ValueError(f"best@{k} with m={m} needs {need} rollouts, only {n} given")
    if pool == "slots" and not 1 <= k <= n * m:
        raise ValueError(f"best@{k} from answer slots needs 1 <= k <= n*m = {n * m}")
    missing = ~np.isfinite(s)
    floor = float(min(0.0, s[~missing].min())) if (~missing).any() else 0.0  # "no answer" scores the floor
    s = np.where(missing, floor, s)
    if pool == "slots":
        out = best_at_k(s.reshape(s.shape[:-2] + (n * m,)), k)
        return float(out) if s.ndim == 2 else np.asarray(out)
    full = s.max(axis=-1)  # (..., n)
    if rest == 0:
        out = best_at_k(full, full_chains)
    else:
        partial = s[..., :rest].max(axis=-1)  # (..., n)
        if full_chains == 0:
            out = partial.mean(axis=-1)
        else:
            total = np.zeros(s.shape[:-2])
            for j in range(n):  # chain j is the partial one; the full ones come from the other n-1
                others = np.delete(full, j, axis=-1)
                total = total + best_at_k(np.maximum(others, partial[..., j : j + 1]), full_chains)
            out = total / n
    return float(out) if s.ndim == 2 else np.asarray(out)


def mean_offdiag_correlation(rewards: np.ndarray) -> float:
    """rho-bar (VPO App. F): mean off-diagonal Pearson correlation of the reward dimensions;
    constant dimensions are left out. NaN if fewer than 2 varying dimensions."""
    r = np.asarray(rewards, dtype=np.float64)
    keep = (~np.isnan(r).any(0)) & (np.nanstd(r, axis=0) > 0)
    r = r[:, keep]
    if r.shape[1] < 2:
        return float("nan")
    c = np.corrcoef(r, rowvar=False)
    iu = np.triu_indices(c.shape[0], 1)
    return float(c[iu].mean())


def hedge_values(scal: np.ndarray, probs: np.ndarray, k_max: int = 3) -> list[float]:
    """Best expected best-of-k for k = 1..k_max (at most 3) when the k candidates, rows of ``scal``
    (candidate x outcome scores), are chosen before the outcome (distributed as ``probs``) is seen;
    exhaustive over the candidates. The gap between k = 1 and k > 1 is what hedging is worth."""
    if not 1 <= k_max <= 3:
        raise ValueError(f"k_max must be 1, 2 or 3, got {k_max}")
    values = [float((scal @ probs).max())]
    if k_max >= 2:
        pair = np.maximum(scal[:, None, :], scal[None, :, :])
        values.append(float((pair @ probs).max()))
    if k_max >= 3:  # exact: fix the first candidate, search pairs for the rest
        values.append(max(float((np.maximum(pair, s) @ probs).max()) for s in scal))
    return values


def greedy_hedge_curve(scal: np.ndarray, probs: np.ndarray, k_max: int) -> list[float]:
    """Greedy best-of-k for k = 1..k_max on the same inputs as :func:`hedge_values`: add, one at a
    time, the candidate that raises the expected best most. Expected best-of-k is monotone
    submodular in the set, so entry k is within a factor 1 - 1/e of the optimum (exact at k = 1)."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    cur = np.zeros(len(probs))
    out = []
    for _ in range(k_max):
        gains = np.maximum(scal, cur) @ probs
        i = int(gains.argmax())
        cur = np.maximum(cur, scal[i])
        out.append(float(gains[i]))
    return out
