"""Hostile candidates beside honest ones, N times: does every attack stay contained, and does any
honest verdict change? Run it on a loaded machine (e.g. with ``benchmarks/sandbox.py`` beside it).

Each repetition is one batch: every hostile class of ``tests/sandbox_hostile.py`` plus the honest
candidates, in a fresh order, on one Sandbox (its limits: ``CONFIG`` there). After each batch the
sandbox's own cgroup must hold nothing of it. Prints one row per class: runs, contained, and for
the honest candidates how many verdicts changed; ``--json`` prints the table as JSON.

    .venv/bin/python benchmarks/sandbox_attacks.py --repeat 20
    .venv/bin/python benchmarks/sandbox_attacks.py --repeat 3 --cgroups off --no-seccomp   # what escapes without them
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.sandbox_hostile import CONFIG, HONEST, HOSTILE, LEFTOVER, check_batch
from vpo.sandbox import Sandbox


def main(argv: list[str] | None = None) -> dict[str, dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20, help="batches (repetitions of every class)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the job order in each batch")
    ap.add_argument("--cgroups", choices=("require", "auto", "off"), default="require")
    ap.add_argument("--no-seccomp", action="store_true", help="run without the system-call filter (weaker mode)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = replace(CONFIG, cgroups=args.cgroups, seccomp=not args.no_seccomp)
    names = [h.name for h in HOSTILE] + list(HONEST)
    jobs = [h.job for h in HOSTILE] + list(HONEST.values())
    table = {n: {"runs": 0, "ok": 0, "examples": []} for n in [*names, LEFTOVER]}
    rng = random.Random(args.seed)
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with Sandbox(cfg) as box:
        prot = box.probe()
        for rep in range(args.repeat):
            order = list(range(len(jobs)))
            rng.shuffle(order)
            results = box.run([jobs[i] for i in order])
            leftover = box.processes()
            by_index = dict(zip(order, results))
            report = check_batch(names, [by_index[i] for i in range(len(jobs))], leftover)
            for name, why in report.items():
                row = table[name]
                row["runs"] += 1
                row["ok"] += why is None
                if why is not None and len(row["examples"]) < 2:
                    row["examples"].append(f"rep {rep}: {why}")
            print(f"batch {rep + 1}/{args.repeat}: {sum(w is not None for w in report.values())} problem(s), "
                  f"load avg {os.getloadavg()[0]:.1f}", file=sys.stderr)
    elapsed = time.monotonic() - t0
    if args.json:
        print(json.dumps({"table": table, "seconds": round(elapsed, 1), "load_avg_before": round(load0, 2),
                          "cgroup": prot.get("cgroup"), "seccomp": prot.get("seccomp")}))
        return table
    print(f"{args.repeat} batches of {len(HOSTILE)} hostile + {len(HONEST)} honest candidates, {cfg.workers} workers, "
          f"cgroup={prot.get('cgroup', {}).get('version')}, seccomp={prot.get('seccomp')}, {elapsed:.0f} s, "
          f"load avg {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'class':36} {'runs':>5} {'contained':>10} {'honest verdicts changed':>24}")
    for name in names + [LEFTOVER]:
        row = table[name]
        if name in HONEST:
            print(f"{name:36} {row['runs']:5d} {'':>10} {row['runs'] - row['ok']:24d}")
        else:
            print(f"{name:36} {row['runs']:5d} {row['ok']:10d} {'':>24}")
        for ex in row["examples"]:
            print(f"    {ex[:150]}")
    return table


if __name__ == "__main__":
    main()
