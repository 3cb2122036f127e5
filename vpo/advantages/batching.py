"""Reward sets padded into one batch, and the group statistics every estimator is built from.

``reward_sets`` holds one (m_i, d) matrix per rollout (m_i may be 0: an unparseable rollout scores
0); NaN marks an absent dimension. Rollouts are padded into an (N, M, d) tensor with a row mask,
and group statistics use scatter sums or a padded (groups, size) table, never a Python loop per
group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ArrayLike", "Groups", "RewardBatch", "as_reward_batch", "group_index", "group_zscore",
           "masked_normalise", "present_dims"]

ArrayLike = np.ndarray | torch.Tensor | Sequence[Sequence[float]]


@dataclass(frozen=True)
class RewardBatch:
    """Padded reward sets: ``values`` (N, M, d) float64 with NaN = absent dimension (padding rows
    are 0 on present dims), ``rows`` (N, M) bool marking real answers."""

    values: torch.Tensor
    rows: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.values.shape[0])

    @property
    def d(self) -> int:
        return int(self.values.shape[2])


def as_reward_batch(reward_sets: Any) -> RewardBatch:
    """Pad a sequence of (m_i, d) matrices into a :class:`RewardBatch`.

    A 3-D array (N, M, d) is taken as N full sets of M answers; a 2-D array (N, d) as N single
    answers. A sequence may mix m_i (including 0); all matrices must share d.
    """
    if isinstance(reward_sets, RewardBatch):
        return reward_sets
    if isinstance(reward_sets, (np.ndarray, torch.Tensor)):
        t = torch.as_tensor(np.asarray(reward_sets, dtype=np.float64) if isinstance(reward_sets, np.ndarray)
                            else reward_sets.detach().cpu().to(torch.float64))
        if t.ndim == 2:
            t = t[:, None, :]
        if t.ndim != 3:
            raise ValueError(f"reward_sets array must be (N, M, d) or (N, d), got shape {tuple(t.shape)}")
        return RewardBatch(t, torch.ones(t.shape[:2], dtype=torch.bool))
    if isinstance(reward_sets, list) and reward_sets and all(isinstance(r, np.ndarray) for r in reward_sets):
        try:  # the common case, every set a full (M, d) matrix: one stack, no padding
            full = np.array(reward_sets, dtype=np.float64)
        except ValueError:
            full = None
        if full is not None and full.ndim == 3 and full.shape[1] > 0:
            return RewardBatch(torch.from_numpy(full), torch.ones(full.shape[:2], dtype=torch.bool))
    mats = [np.asarray(r, dtype=np.float64) for r in reward_sets]
    if not mats:
        raise ValueError("reward_sets is empty")
    dims = {m.shape[1] for m in mats if m.ndim == 2 and m.shape[0] > 0}
    for i, m in enumerate(mats):
        if m.ndim != 2 and not (m.ndim == 1 and m.size == 0):
            raise ValueError(f"reward_sets[{i}] must be an (m_i, d) matrix, got shape {m.shape}")
    if len(dims) > 1:
        raise ValueError(f"reward_sets mix dimensionalities {sorted(dims)}; pad absent dimensions with NaN")
    if not dims:
        dims = {max((m.shape[1] for m in mats if m.ndim == 2), default=1)}
    d = dims.pop()
    big_m = max(1, max(m.shape[0] if m.ndim == 2 else 0 for m in mats))
    values = np.zeros((len(mats), big_m, d))
    rows = np.zeros((len(mats), big_m), dtype=bool)
    lengths = np.array([m.shape[0] if m.ndim == 2 else 0 for m in mats])
    rows[np.arange(big_m)[None, :] < lengths[:, None]] = True
    nonempty = [m for m in mats if m.ndim == 2 and m.shape[0] > 0]
    if nonempty:
        values[rows] = np.concatenate(nonempty, axis=0)
    return RewardBatch(torch.from_numpy(values), torch.from_numpy(rows))


def group_index(group_ids: Any) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to contiguous indices 0..G-1 (first-seen order)."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.detach().cpu().numpy()
    arr = group_ids if isinstance(group_ids, np.ndarray) else None
    if arr is None and isinstance(group_ids, list) and group_ids and isinstance(group_ids[0], (int, np.integer)):
        arr = np.asarray(group_ids)
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iub":
        _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
        rank = np.empty(first.size, dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(first.size)
        return torch.from_numpy(rank[inverse.reshape(-1)]), int(first.size)
    if isinstance(group_ids, np.ndarray):
        group_ids = group_ids.tolist()
    mapping: dict[Hashable, int] = {}
    idx = [mapping.setdefault(g if not isinstance(g, list) else tuple(g), len(mapping)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long), len(mapping)


@dataclass(frozen=True)
class Groups:
    """The prompt groups of a batch: ``index`` (N,) contiguous group of each rollout (first-seen
    order), ``count`` groups, and the caller's ``ids`` as given (they name the prompts where an
    estimator needs names and none were passed)."""

    index: torch.Tensor
    count: int
    ids: Any

    @classmethod
    def of(cls, group_ids: Any, n: int) -> Groups:
        """The groups of ``n`` rollouts from one id per rollout (any hashables)."""
        index, count = group_index(group_ids)
        if index.numel() != n:
            raise ValueError(f"{n} reward sets but {index.numel()} group ids")
        return cls(index, count, group_ids)

    def id_list(self) -> list[Any]:
        """The caller's group ids as a plain list."""
        ids = self.ids
        return ids.tolist() if isinstance(ids, (np.ndarray, torch.Tensor)) else list(ids)


def group_sum(x: torch.Tensor, gidx: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(G, ...) sums of ``x`` (N, ...) over each group's rollouts."""
    out = torch.zeros((n_groups,) + tuple(x.shape[1:]), dtype=x.dtype)
    return out.index_add_(0, gidx, x)


def contiguous_size(gidx: torch.Tensor, n_groups: int) -> int:
    """S if the batch is G contiguous groups of S rollouts each (TRL's layout), else 0."""
    n = gidx.numel()
    if not n_groups or n % n_groups:
        return 0
    size = n // n_groups
    return size if torch.equal(gidx, torch.arange(n) // size) else 0


def group_table(gidx: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, S_max) rollout indices of each group in batch order, padded with N (one past the last
    rollout), and the (G,) group sizes."""
    n = gidx.numel()
    sizes = torch.bincount(gidx, minlength=n_groups)
    order = torch.argsort(gidx, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes
    table = torch.full((n_groups, int(sizes.max()) if n else 0), n, dtype=torch.long)
    table[gidx[order], torch.arange(n) - starts[gidx[order]]] = order
    return table, sizes


def by_group_size(gidx: torch.Tensor, n_groups: int) -> list[tuple[int, torch.Tensor]]:
    """[(size, (groups of that size, size) rollout indices)] for every group size in the batch."""
    table, sizes = group_table(gidx, n_groups)
    return [(int(s), table[sizes == s][:, : int(s)]) for s in torch.unique(sizes).tolist()]


def padded(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (N, ...) laid out as (G, S_max, ...) by the group table, NaN in the padding."""
    pad = torch.full((1,) + tuple(x.shape[1:]), float("nan"), dtype=x.dtype)
    return torch.cat([x, pad])[table]


def group_zscore(scores: torch.Tensor, gidx: torch.Tensor, n_groups: int, eps: float = 1e-6, *,
                 unbiased: bool = False) -> torch.Tensor:
    """(s - mean_g) / (std_g + eps), 0 where std_g < eps. Population std (VPO, as the authors) by
    default; ``unbiased=True`` uses the sample std (n - 1), as verl's GRPO; a group of one gets 0."""
    scores = scores.to(torch.float64)
    size = contiguous_size(gidx, n_groups)
    if size:  # TRL's layout: plain reductions over a (G, S) view
        x = scores.reshape((n_groups, size) + tuple(scores.shape[1:]))
        centred = x - x.mean(dim=1, keepdim=True)
        sq = (centred * centred).sum(dim=1, keepdim=True)
        if unbiased:
            std = torch.sqrt(sq / (size - 1)) if size > 1 else torch.zeros_like(sq)
        else:
            std = torch.sqrt(sq / size)
        adv = centred / (std + eps)
        return torch.where(std < eps, torch.zeros_like(adv), adv).reshape(scores.shape)
    count = group_sum(torch.ones_like(scores), gidx, n_groups)
    mean = group_sum(scores, gidx, n_groups) / count
    centred = scores - mean[gidx]
    sq = group_sum(centred * centred, gidx, n_groups)
    if unbiased:
        std = torch.where(count > 1, torch.sqrt(sq / (count - 1).clamp(min=1)), torch.zeros_like(sq))
    else:
        std = torch.sqrt(sq / count)
    adv = centred / (std[gidx] + eps)
    return torch.where(std[gidx] < eps, torch.zeros_like(adv), adv)


def present_dims(batch: RewardBatch, gidx: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(G, d) bool: a dimension is present in a group if any real answer there has it non-NaN."""
    if not np.isnan(batch.values.detach().cpu().numpy()).any():  # nothing absent anywhere
        return torch.ones((n_groups, batch.d), dtype=torch.bool)
    finite = (~torch.isnan(batch.values)) & batch.rows[:, :, None]
    per_rollout = finite.any(dim=1).to(torch.float64)
    present = group_sum(per_rollout, gidx, n_groups) > 0
    none = ~present.any(dim=1)
    if none.any():  # a group without any real answer: treat all dims as present (scores are 0 anyway)
        present[none] = True
    return present


def masked_normalise(w: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Zero absent dims and renormalise to the simplex. w: (..., d); present broadcastable."""
    w = w * present.to(w.dtype)
    total = w.sum(dim=-1, keepdim=True)
    return w / torch.where(total > 0, total, torch.ones((), dtype=w.dtype))  # all-zero rows stay 0


def clean(batch: RewardBatch) -> torch.Tensor:
    """Values with NaN -> 0 (absent dims carry zero weight anyway)."""
    return torch.nan_to_num(batch.values, nan=0.0)
