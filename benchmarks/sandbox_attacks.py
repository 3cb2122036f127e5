"""Hostile candidates beside honest ones, N times: does every attack stay contained, and does any
honest verdict change? Run it on a loaded machine (e.g. with ``benchmarks/sandbox.py`` beside it).

Each repetition is one batch per group of ``tests/support/hostile.py`` (``base``; ``site``, whose
sandbox imports from site-packages): the group's hostile classes plus every honest candidate, in
a fresh order, on that group's Sandbox (its limits: ``CONFIGS`` there). After each batch the
sandbox's own cgroup must hold nothing of it. Prints one row per class: runs, contained, the CPU
seconds charged to the candidate (median and max over the runs) and its wall-clock seconds
(median), and for the honest candidates how many verdicts changed; then this process's own CPU
seconds and the load average. ``--json`` prints the table as JSON.

    .venv/bin/python benchmarks/sandbox_attacks.py --repeat 20
    .venv/bin/python benchmarks/sandbox_attacks.py --repeat 3 --cgroups off --no-seccomp   # what escapes without them
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.hostile import CONFIGS, HONEST, HOSTILE, LEFTOVER, check_batch, group_jobs
from vpo.sandbox import Sandbox


def _cpu_seconds() -> float:
    """CPU seconds of this process (the parent: reading, judging) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> dict[str, dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20, help="batches per group (repetitions of every class)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the job order in each batch")
    ap.add_argument("--cgroups", choices=("require", "auto", "off"), default="require")
    ap.add_argument("--no-seccomp", action="store_true", help="run without the system-call filter (weaker mode)")
    ap.add_argument("--groups", default=",".join(CONFIGS), help=f"comma-separated groups to run (of {', '.join(CONFIGS)})")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown group(s) {sorted(unknown)}; expected {sorted(CONFIGS)}")
    table: dict[str, dict[str, object]] = {}
    for h in HOSTILE:
        if h.group in groups:
            table[h.name] = {"runs": 0, "ok": 0, "examples": [], "cpu": [], "wall": []}
    for g in groups:
        for name in HONEST:
            table[f"{name} [{g}]"] = {"runs": 0, "ok": 0, "examples": [], "cpu": [], "wall": []}
    table[LEFTOVER] = {"runs": 0, "ok": 0, "examples": [], "cpu": [], "wall": []}
    rng = random.Random(args.seed)
    load0, cpu0, t0 = os.getloadavg()[0], _cpu_seconds(), time.monotonic()
    prots = {}
    boxes = {g: Sandbox(replace(CONFIGS[g], cgroups=args.cgroups, seccomp=not args.no_seccomp)) for g in groups}
    try:
        for g, box in boxes.items():
            prots[g] = box.probe()
        for rep in range(args.repeat):
            problems = 0
            for g, box in boxes.items():
                names, jobs = group_jobs(g)
                order = list(range(len(jobs)))
                rng.shuffle(order)
                results = box.run([jobs[i] for i in order])
                leftover = box.processes()
                by_index = dict(zip(order, results))
                ordered = [by_index[i] for i in range(len(jobs))]
                report = check_batch(names, ordered, leftover)
                for name, why in report.items():
                    key = f"{name} [{g}]" if name in HONEST else name
                    row = table[key]
                    row["runs"] += 1
                    row["ok"] += why is None
                    problems += why is not None
                    if why is not None and len(row["examples"]) < 2:
                        row["examples"].append(f"rep {rep}: {why}")
                for name, r in zip(names, ordered):
                    row = table[f"{name} [{g}]" if name in HONEST else name]
                    row["cpu"].append(r.cpu)
                    row["wall"].append(r.wall)
            print(f"batch {rep + 1}/{args.repeat}: {problems} problem(s), load avg {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)
    finally:
        for box in boxes.values():
            box.close()
    elapsed, cpu = time.monotonic() - t0, _cpu_seconds() - cpu0
    for row in table.values():
        times = row.pop("cpu"), row.pop("wall")
        row["cpu_median"] = round(statistics.median(times[0]), 3) if times[0] else None
        row["cpu_max"] = round(max(times[0]), 3) if times[0] else None
        row["wall_median"] = round(statistics.median(times[1]), 3) if times[1] else None
    base = prots.get("base") or next(iter(prots.values()))
    if args.json:
        print(json.dumps({"table": table, "seconds": round(elapsed, 1), "parent_cpu_seconds": round(cpu, 1),
                          "load_avg_before": round(load0, 2), "load_avg_after": round(os.getloadavg()[0], 2),
                          "cgroup": base.get("cgroup"), "seccomp": base.get("seccomp")}))
        return table
    n_hostile = sum(1 for h in HOSTILE if h.group in groups)
    print(f"{args.repeat} batches of {n_hostile} hostile + {len(HONEST)} honest candidates per group ({', '.join(groups)}), "
          f"{CONFIGS['base'].workers} workers, cgroup={base.get('cgroup', {}).get('version')}, seccomp={base.get('seccomp')}, "
          f"{elapsed:.0f} s wall, {cpu:.0f} CPU s in this process, load avg {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'class':36} {'runs':>5} {'contained':>10} {'honest changed':>15} {'cpu med/max s':>15} {'wall med s':>11}")
    for name, row in table.items():
        times = f"{row['cpu_median']}/{row['cpu_max']}" if row["cpu_median"] is not None else ""
        wall = f"{row['wall_median']}" if row["wall_median"] is not None else ""
        if name.split(" [")[0] in HONEST:
            print(f"{name:36} {row['runs']:5d} {'':>10} {row['runs'] - row['ok']:15d} {times:>15} {wall:>11}")
        else:
            print(f"{name:36} {row['runs']:5d} {row['ok']:10d} {'':>15} {times:>15} {wall:>11}")
        for ex in row["examples"]:
            print(f"    {ex[:150]}")
    return table


if __name__ == "__main__":
    main()
