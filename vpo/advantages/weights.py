"""Weightings: Dirichlet draws over each group's present dimensions, the per-prompt weighting fixed by
(seed, prompt id), and goal conditioning, which writes a prompt's weighting into the prompt itself.

``dirichlet`` draws iid Gamma(alpha) variates and normalises them (alpha = 1: exponentials from
32-bit uniforms; alpha < 1: built in log space, so no weighting is NaN for any alpha > 0); ``sobol``
maps one scrambled Sobol set, shifted per group, through the Gamma(alpha) inverse CDF.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from vpo.advantages.batching import ArrayLike
from vpo.answers import append_to_prompt

__all__ = ["GOAL_WEIGHTS_COLUMN", "goal_condition_rows", "goal_prompt", "prompt_weights", "sample_weights"]

#: Dataset column holding each prompt's goal weighting (a list of d floats, or its JSON text).
GOAL_WEIGHTS_COLUMN = "goal_weights"


def fixed_weights(w_star: ArrayLike | None, d: int) -> torch.Tensor:
    """The fixed scalarisation w* as a (d,) float64 tensor (default: the uniform mean), checked."""
    if w_star is None:
        return torch.full((d,), 1.0 / d, dtype=torch.float64)
    w = torch.as_tensor(np.asarray(w_star, dtype=np.float64))
    if w.shape != (d,):
        raise ValueError(f"w_star has shape {tuple(w.shape)}, expected ({d},)")
    if (w < 0).any() or not torch.isfinite(w).all():
        raise ValueError("w_star must be finite and non-negative")
    return w


def weight_matrix(weights: ArrayLike, rows: int | None, d: int, what: str) -> np.ndarray:
    """Given weightings as a float64 (rows, d) array (any number of rows if ``rows`` is None):
    finite and non-negative, or a clear error."""
    w = np.asarray(weights.detach().cpu() if isinstance(weights, torch.Tensor) else weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] != d or (rows is not None and w.shape[0] != rows):
        raise ValueError(f"weights must be ({what}) = ({rows if rows is not None else 'K'}, {d}), got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        bad = np.argwhere(~np.isfinite(w) | (w < 0))[0]
        raise ValueError(f"weights must be finite and non-negative; row {bad[0]}, dimension {bad[1]} is {w[tuple(bad)]}")
    return w


# -- Dirichlet sampling --------------------------------------------------------------------------
def _seed_from(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())



def _exponentials(seed: int, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Exp(1) = Gamma(1) draws -log(u) with u = (b + 1/2) / 2^32 from 32 random bits b (SFC64):
    each in (1.2e-10, 22.9], never 0, at half the random bits (and time) of 53-bit uniforms."""
    size = math.prod(shape)
    bits = np.random.SFC64(seed).random_raw((size + 1) // 2).view(np.uint32)[:size]
    x = np.empty(size) if out is None else out.reshape(size)
    np.add(bits, 0.5, out=x)
    np.log(x, out=x)
    np.subtract(32 * math.log(2.0), x, out=x)
    return x.reshape(shape)


def _log_gammas(rng: np.random.Generator, alpha: float, shape: tuple[int, ...] | int) -> np.ndarray:
    """log of Gamma(alpha) draws. Below alpha = 1 they are built in log space as
    log G(alpha + 1) + log(U) / alpha (G(a) = G(a + 1) U^(1/a)), so no draw underflows to 0 however
    small alpha is (a Gamma(0.001) variate is below 1e-308 about half the time)."""
    if alpha >= 1.0:
        return np.log(np.maximum(rng.standard_gamma(alpha, size=shape), np.finfo(np.float64).tiny))
    g = np.maximum(rng.standard_gamma(alpha + 1.0, size=shape), np.finfo(np.float64).tiny)
    return np.log(g) + np.log1p(-rng.random(size=shape)) / alpha  # 1 - U in (0, 1]: finite log


def _log_gamma_quantiles(alpha: float, u: np.ndarray) -> np.ndarray:
    """log of the Gamma(alpha) inverse CDF at u, in log space where the quantile underflows:
    P(alpha, x) ~ x^alpha / Gamma(alpha + 1) as x -> 0 gives log x = (log u + lgamma(alpha + 1)) / alpha."""
    from scipy.special import gammaincinv, gammaln

    x = gammaincinv(alpha, u)
    with np.errstate(divide="ignore"):
        return np.where(x < 1e-250, (np.log(u) + gammaln(alpha + 1.0)) / alpha, np.log(x))


def _from_log(logg: np.ndarray, present: np.ndarray | None, axis: int) -> np.ndarray:
    """exp(logg) rescaled along ``axis`` so each weighting's largest present entry is 1 (absent
    entries 0): the same direction on the simplex, with no underflow of the whole weighting."""
    if present is not None:
        logg = np.where(present, logg, -np.inf)
    return np.exp(logg - logg.max(axis=axis, keepdims=True))


def gamma_draws(
    n_groups: int,
    num_weights: int,
    d: int,
    *,
    alpha: float,
    sampler: str,
    generator: torch.Generator | None,
    present: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """(G, d, K) positive draws whose (group, k) columns, divided by their sum over the group's
    present dims, are K iid Dir(alpha) weightings on those dims; absent dims (``present`` (G, d)
    False) are 0. Unnormalised so the estimator divides K maxima instead of K x d weights.
    ``out`` (G, d, K) receives the alpha = 1 draws (the common case) if given."""
    if num_weights < 1:
        raise ValueError(f"num_weights must be >= 1, got {num_weights}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    mask = None if present is None else np.asarray(present, dtype=bool)[:, :, None]
    if sampler == "dirichlet":
        if alpha == 1.0:
            g = _exponentials(_seed_from(generator), (n_groups, d, num_weights), out)
            return g if mask is None else np.multiply(g, mask, out=g)
        logg = _log_gammas(np.random.default_rng(_seed_from(generator)), alpha, (n_groups, d, num_weights))
    elif sampler == "sobol":
        engine = torch.quasirandom.SobolEngine(dimension=d, scramble=True, seed=_seed_from(generator))
        base = engine.draw(num_weights, dtype=torch.float64).numpy().T  # (d, K)
        shift = torch.rand((n_groups, d, 1), generator=generator, dtype=torch.float64).numpy()
        u = np.add(base[None], shift, out=out if alpha == 1.0 else None)  # in [0, 2): wrap to [0, 1)
        u -= u >= 1.0  # (np.remainder is ~10x slower)
        np.clip(u, 1e-12, 1 - 1e-12, out=u)
        if alpha == 1.0:
            np.negative(np.log1p(np.negative(u, out=u), out=u), out=u)
            return u if mask is None else np.multiply(u, mask, out=u)
        logg = _log_gamma_quantiles(alpha, u)
    else:
        raise ValueError(f"unknown sampler {sampler!r}; expected 'dirichlet' or 'sobol'")
    return _from_log(logg, mask, axis=1)


def sample_weights(
    n_groups: int,
    num_weights: int,
    d: int,
    *,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    present: ArrayLike | None = None,
) -> torch.Tensor:
    """Draw (n_groups, K, d) weightings, each row ~ Dir(alpha) over the group's ``present`` dims
    ((n_groups, d) bool; default all), absent dims 0; the draws :func:`vpo_advantage` uses.

    ``dirichlet``: iid Gamma(alpha) draws normalised (alpha = 1: exponentials from 32-bit
    uniforms; alpha < 1: built in log space, so no row is NaN for any alpha > 0). ``sobol``: one
    scrambled Sobol set of K points, randomised per group by a Cranley-Patterson shift, mapped
    through the Gamma(alpha) inverse CDF (quasi-Monte-Carlo; lower variance of the K-average).
    Both are deterministic given ``generator``.
    """
    mask = None if present is None else np.asarray(
        present.detach().cpu() if isinstance(present, torch.Tensor) else present, dtype=bool)
    if mask is not None and mask.shape != (n_groups, d):
        raise ValueError(f"present must be ({n_groups}, {d}), got {mask.shape}")
    if mask is not None and not mask.any(axis=1).all():
        raise ValueError(f"present row {int(np.flatnonzero(~mask.any(axis=1))[0])} has no present dimension")
    g = gamma_draws(n_groups, num_weights, d, alpha=alpha, sampler=sampler, generator=generator, present=mask)
    w = g / g.sum(axis=1, keepdims=True)
    return torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1)))


def _stable_key(prompt_id: Hashable) -> int:
    """A 64-bit key of a prompt id's text, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(str(prompt_id).encode("utf-8"), digest_size=8).digest(), "little")


def prompt_weights(prompt_ids: Sequence[Hashable], d: int, *, seed: int = 0, alpha: float = 1.0,
                   present: ArrayLike | None = None) -> np.ndarray:
    """(len(prompt_ids), d) weightings w ~ Dir(alpha), one per prompt, a pure function of
    (seed, prompt id): a prompt gets the same weighting in every epoch, on every rank and in every
    process. Ids are keyed by their text (``3`` and ``"3"`` agree). ``present`` (n, d) bool
    restricts a row to its present dims (absent 0)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    cache: dict[int, np.ndarray] = {}
    logg = np.empty((len(prompt_ids), d))
    for i, pid in enumerate(prompt_ids):
        key = _stable_key(pid)
        if key not in cache:
            cache[key] = _log_gammas(np.random.default_rng([int(seed), key]), alpha, d)
        logg[i] = cache[key]
    mask = None
    if present is not None:
        mask = np.asarray(present.detach().cpu() if isinstance(present, torch.Tensor) else present, dtype=bool)
        if mask.shape != logg.shape:
            raise ValueError(f"present must be {logg.shape}, got {mask.shape}")
        if not mask.any(axis=1).all():
            raise ValueError(f"prompt {prompt_ids[int(np.flatnonzero(~mask.any(axis=1))[0])]!r} has no present dimension")
    g = _from_log(logg, mask, axis=1)
    return g / g.sum(axis=1, keepdims=True)


# -- goal conditioning: the weighting reaches the prompt and the reward ----------------------------
def goal_prompt(prompt: Any, weights: ArrayLike, names: Sequence[str]) -> Any:
    """``prompt`` with its goal weighting appended: text prompts at the end, chat prompts (a list
    of role/content dicts) at the end of the last user message. Dimensions of weight 0 (absent)
    are not listed. The input is never mutated."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(names),):
        raise ValueError(f"goal weights have shape {w.shape}, the reward has {len(names)} dimensions")
    lines = "\n".join(f"- {name}: {wi:.2f}" for name, wi in zip(names, w) if wi > 0)
    block = ("Objective weights (higher = more important); your reward is the weighted sum of the "
             f"objectives:\n{lines}")
    return append_to_prompt(prompt, block, what="the goal weights")


def goal_condition_rows(
    rows: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    *,
    seed: int,
    alpha: float = 1.0,
    present: Callable[[Mapping[str, Any]], ArrayLike] | None = None,
    id_key: str = "id",
    prompt_key: str = "prompt",
) -> list[dict[str, Any]]:
    """Goal-conditioned GRPO's prompt transform, task-independent: each row's already formatted
    ``prompt`` gains its weighting w = :func:`prompt_weights` (row id, ``seed``, ``alpha``; over
    ``present(row)`` dims if given) and the row gains the column ``goal_weights`` (w as a list),
    which VPOTrainer hands to ``goal_conditioned_grpo`` so the reward is scored with the very
    weighting the prompt shows. Returns new rows."""
    ids = []
    for i, row in enumerate(rows):
        if id_key not in row or prompt_key not in row:
            raise KeyError(f"goal_condition_rows: row {i} has no {id_key if id_key not in row else prompt_key!r} column")
        ids.append(row[id_key])
    mask = None if present is None else np.stack([np.asarray(present(row), dtype=bool) for row in rows])
    w = prompt_weights(ids, len(names), seed=seed, alpha=alpha, present=mask)
    return [{**row, prompt_key: goal_prompt(row[prompt_key], wi, names), GOAL_WEIGHTS_COLUMN: wi.tolist()}
            for row, wi in zip(rows, w)]
