"""Would the main job's warm-up (SFT) gain from running as two processes instead of one?

    .venv/bin/python benchmarks/sft_split.py                 # 40 steps per try, 3 tries each way
    .venv/bin/python benchmarks/sft_split.py --steps 100 --repeat 5

The base stage's SFT is the longest part of ``make run`` that runs once whatever
``execution.max_parallel`` says, so it bounds how much running arms side by side can save. This
script times the main job's SFT step (the ``route`` pipeline's tiny model, batch and optimizer) two
ways on the same data and the same number of cores N (``--processes``, default: this process's cores):

* ``one process``: the whole batch in one process with N torch threads (what the base stage does);
* ``N processes``: data-parallel, each process one thread and 1/N of every batch; the gradients are
  gathered (``torch.distributed``, gloo) and summed in a fixed order, so each process takes the
  same optimizer step.

Both ways compute each shard's gradient separately and sum them in shard order, so they must end
with the same weights byte for byte (checked; exit 1 otherwise). The two ways alternate, so a busy
spell of the machine hits both; it prints seconds per step for every try, their mean and spread.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vpo.pipeline.engine.execution import Machine


def _worker(rank: int, world: int, shards: int, steps: int, init: str, rendezvous: str, out: Any) -> None:
    """Train ``steps`` SFT steps on this rank's shards; rank 0 puts (seconds per step, weights) on ``out``."""
    torch.set_num_threads(1 if world > 1 else shards)  # N cores either way
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vpo.chat import model_prompt
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.engine.context import build_task
    from vpo.sft import make_batch

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    cfg = load_pipeline("route")
    task = build_task(cfg)
    tok = AutoTokenizer.from_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.sft.lr)
    rows = task.load("train")
    rng = random.Random(cfg.seed)  # every rank draws the whole batch, so all stay in step
    size = cfg.sft.batch_size // shards
    mine = [s for s in range(shards) if s % world == rank]
    start = time.perf_counter()
    for _ in range(steps):
        m = 3 if rng.random() < 0.5 else 1
        picked = [rows[rng.randrange(len(rows))] for _ in range(size * shards)]
        prompts = [str(model_prompt(task, r, m, tok, render=True)) for r in picked]
        batch = make_batch(tok, prompts, [task.demonstration(r, m, rng) for r in picked])
        counted = batch["labels"][:, 1:] != -100
        total = int(counted.sum())
        grads = {}
        for s in mine:
            part = {k: v[s * size:(s + 1) * size] for k, v in batch.items()}
            opt.zero_grad(set_to_none=True)
            (model(**part).loss * (int(counted[s * size:(s + 1) * size].sum()) / total)).backward()
            grads[s] = torch.cat([p.grad.reshape(-1) for p in params])
        if world > 1:
            gathered = [torch.empty_like(grads[mine[0]]) for _ in range(world)]
            for k in range(len(mine)):  # round k: every rank's k-th shard
                dist.all_gather(gathered, grads[mine[k]])
                grads.update({k * world + r: g.clone() for r, g in enumerate(gathered)})
        flat = grads[0].clone()
        for s in range(1, shards):  # one fixed order, so every way of running sums the same floats
            flat += grads[s]
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    seconds = (time.perf_counter() - start) / steps
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        # as bytes: a tensor would travel as a handle to this process's memory, gone once it exits
        out.put((seconds, torch.cat([p.detach().reshape(-1) for p in params]).numpy().tobytes()))


def _try(world: int, shards: int, steps: int, init: str, rendezvous: str) -> tuple[float, bytes]:
    """One try: ``world`` processes (spawned) meeting at the file ``rendezvous``; rank 0's result."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, shards, steps, init, rendezvous, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a worker of the {world}-process try exited {p.exitcode}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="SFT steps per try")
    ap.add_argument("--repeat", type=int, default=3, help="tries each way")
    cores = Machine.detect().cores
    ap.add_argument("--processes", type=int, default=cores, help="processes of the data-parallel way")
    args = ap.parse_args(argv)
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.engine.context import build_task
    from vpo.tiny import build_tiny_model

    cfg = load_pipeline("route")
    if cfg.sft.batch_size % args.processes:
        raise SystemExit(f"sft.batch_size {cfg.sft.batch_size} does not split into {args.processes} processes")
    with tempfile.TemporaryDirectory() as tmp:
        init = str(build_tiny_model(Path(tmp) / "init", build_task(cfg).charset, seed=cfg.seed,
                                    **dict(cfg.model.builder_params)))
        ways = {"one process": 1, f"{args.processes} processes": args.processes}
        times: dict[str, list[float]] = {w: [] for w in ways}
        weights: dict[str, bytes] = {}
        for i in range(args.repeat):
            for way, world in ways.items():
                seconds, w = _try(world, args.processes, args.steps, init, f"{tmp}/rendezvous-{i}-{world}")
                times[way].append(seconds)
                weights[way] = w
                print(f"try {i + 1} {way}: {seconds:.4f} s/step", flush=True)
    print(f"\n{cores} cores, {args.steps} steps per try, batch {cfg.sft.batch_size} in {args.processes} shards")
    for way, ts in times.items():
        spread = statistics.stdev(ts) if len(ts) > 1 else 0.0
        print(f"{way}: {statistics.mean(ts):.4f} +- {spread:.4f} s/step")
    one, many = (statistics.mean(t) for t in times.values())
    same = len(set(weights.values())) == 1
    print(f"{args.processes} processes / one process: {many / one:.2f}x the time per step; weights identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
