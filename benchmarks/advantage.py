"""Time vpo_advantage against two loops of the same VPO formula, in one run.

Workload: 128 prompts x 8 rollouts x m=3 answers x d=16 dims x K=100 weights. Two loops: the
reference (vpo/reference.py: reads like the equations, scalar Python over groups, rollouts, K and
answers) and a per-group loop with numpy inside each group, the first thing most users write.
Before timing, the script asserts that the vectorised estimator and both loops give the same
numbers, on given weights and on the weights the estimator samples itself.

    OMP_NUM_THREADS=1 python benchmarks/advantage.py [--repeats 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from vpo.advantages import as_reward_batch, grpo_advantage, max_at_k_advantage, sample_weights, vpo_advantage
from vpo.reference import vpo_advantage_loop


def _time(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def vpo_advantage_group_numpy(sets: list[np.ndarray], gids: np.ndarray, weights: np.ndarray,
                              eps: float = 1e-6) -> np.ndarray:
    """The loop a user would write first: one Python iteration per group, numpy inside the group
    (full (m, d) sets without NaN, as in this workload). ``weights`` is (groups, K, d)."""
    out = np.zeros(len(sets))
    for g in range(weights.shape[0]):
        idx = np.flatnonzero(gids == g)
        r = np.stack([sets[i] for i in idx])                 # (G, m, d)
        scores = (r @ weights[g].T).max(axis=1).mean(axis=1)  # (G,): mean_k max_answers w_k . r
        std = scores.std()
        out[idx] = 0.0 if std < eps else (scores - scores.mean()) / (std + eps)
    return out


def vpo_advantage_group_numpy_sampling(sets: list[np.ndarray], gids: np.ndarray, k: int, d: int,
                                       rng: np.random.Generator, eps: float = 1e-6) -> np.ndarray:
    """The same loop drawing each group's K weightings inside the loop (``rng.dirichlet`` per group),
    as the per-group loop is usually first written."""
    out = np.zeros(len(sets))
    ones = np.ones(d)
    for g in range(int(gids.max()) + 1):
        idx = np.flatnonzero(gids == g)
        r = np.stack([sets[i] for i in idx])
        scores = (r @ rng.dirichlet(ones, size=k).T).max(axis=1).mean(axis=1)
        std = scores.std()
        out[idx] = 0.0 if std < eps else (scores - scores.mean()) / (std + eps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--loop-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    n = args.prompts * args.group
    sets = [rng.integers(0, 2, size=(args.m, args.d)).astype(np.float64) for _ in range(n)]
    gids = np.repeat(np.arange(args.prompts), args.group)

    # correctness: same weights -> same numbers
    w = sample_weights(args.prompts, args.k, args.d, generator=torch.Generator().manual_seed(1)).numpy()
    vec = vpo_advantage(sets, gids, weights=w[0]).numpy()
    ref = vpo_advantage_loop(sets, list(gids), {g: w[0] for g in range(args.prompts)})
    max_err = float(np.abs(vec - ref).max())
    assert max_err < 1e-9, max_err
    grp = vpo_advantage_group_numpy(sets, gids, np.broadcast_to(w[0], (args.prompts, *w[0].shape)))
    max_err_grp = float(np.abs(vec - grp).max())
    assert max_err_grp < 1e-9, max_err_grp
    # the fast path's own draws: the loop fed the same per-group weights gives the same numbers
    sampled = vpo_advantage(sets, gids, num_weights=args.k, generator=torch.Generator().manual_seed(1)).numpy()
    ref_sampled = vpo_advantage_loop(sets, list(gids), {g: w[g] for g in range(args.prompts)})
    max_err_sampled = float(np.abs(sampled - ref_sampled).max())
    assert max_err_sampled < 1e-9, max_err_sampled

    rng_w = np.random.default_rng(5)  # the per-group-drawing loop is the same computation
    drawn = np.stack([rng_w.dirichlet(np.ones(args.d), size=args.k) for _ in range(args.prompts)])
    same = vpo_advantage_group_numpy_sampling(sets, gids, args.k, args.d, np.random.default_rng(5))
    assert float(np.abs(same - vpo_advantage_group_numpy(sets, gids, drawn)).max()) < 1e-12

    batch = as_reward_batch(sets)
    rows = {
        "vpo_advantage (list input, sampling K weights/group)": _time(
            lambda: vpo_advantage(sets, gids, num_weights=args.k, generator=torch.Generator().manual_seed(1)),
            args.repeats),
        "vpo_advantage (pre-padded batch)": _time(
            lambda: vpo_advantage(batch, gids, num_weights=args.k, generator=torch.Generator().manual_seed(1)),
            args.repeats),
        "vpo_advantage sobol (pre-padded batch)": _time(
            lambda: vpo_advantage(batch, gids, num_weights=args.k, sampler="sobol",
                                  generator=torch.Generator().manual_seed(1)), args.repeats),
        "grpo_advantage, TRL's stock formula (list input)": _time(lambda: grpo_advantage(sets, gids), args.repeats),
        "max_at_k_advantage (list input)": _time(lambda: max_at_k_advantage(sets, gids), args.repeats),
        "per-group loop, numpy inside each group (incl. sampling weights)": _time(
            lambda: vpo_advantage_group_numpy(
                sets, gids, np.random.default_rng(1).dirichlet(np.ones(args.d), size=(args.prompts, args.k))),
            args.repeats),
        "per-group loop, numpy inside each group, weights drawn per group": _time(
            lambda: vpo_advantage_group_numpy_sampling(sets, gids, args.k, args.d, np.random.default_rng(1)),
            args.repeats),
        "per-group Python loop (reference)": _time(
            lambda: vpo_advantage_loop(sets, list(gids), {g: w[g] for g in range(args.prompts)}), args.loop_repeats),
    }
    print(f"workload: {args.prompts} prompts x {args.group} rollouts x m={args.m} x d={args.d} x K={args.k}; "
          f"torch threads={args.threads}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"max |vectorised - loop| = {max_err:.2e} (given weights), {max_err_sampled:.2e} (its own draws); "
          f"|vectorised - numpy group loop| = {max_err_grp:.2e}")
    print("| implementation | median ms | min ms |")
    print("|---|---|---|")
    for name, ts in rows.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} |")
    loop = statistics.median(rows["per-group Python loop (reference)"])
    grp_ms = statistics.median(rows["per-group loop, numpy inside each group (incl. sampling weights)"])
    grp_sampling_ms = statistics.median(rows["per-group loop, numpy inside each group, weights drawn per group"])
    for label in ("vpo_advantage (list input, sampling K weights/group)", "vpo_advantage (pre-padded batch)"):
        vpo = statistics.median(rows[label])
        print(f"{label}: {loop / vpo:.0f}x the reference loop, {grp_ms / vpo:.1f}x the numpy-per-group loop "
              f"(weights drawn at once), {grp_sampling_ms / vpo:.1f}x it drawing weights per group (medians)")


if __name__ == "__main__":
    main()
