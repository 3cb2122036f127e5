"""How close the memory plan (vpo.memory) comes to what a real training step uses on this CPU.

Each case runs ``benchmarks/gpu_step.py`` (TRL engine: :class:`vpo.trainer.VPOTrainer`, transformers
generation, float32) in a fresh subprocess per arm for a few optimizer steps with fixed prompt and
completion lengths, and compares the plan's peak with the measured peak RSS (``ru_maxrss``) minus
the process's RSS after its imports. Cases:

* ``runtime``: a model whose tensors are negligible (1 layer, hidden 32, vocabulary 64): what the
  trainer itself adds on CPU; it calibrates :data:`vpo.memory.CPU_RUNTIME` and is not a check;
* ``route``: the route pipeline's tiny char model (vpo.tiny.DEFAULT_SIZE over the route task's
  characters) at the route pipeline's batch (8 prompts x 8 rollouts, one micro-step);
* ``smollm2``: SmolLM2-135M-Instruct's architecture (shipped config.json, random weights), full fine-tune;
* ``smollm2-gc``: the same with gradient checkpointing;
* ``smollm2-lora``: the same with LoRA r=16 on every projection;
* ``smollm2-10l``, ``smollm2-10l-lora``: the same architecture with 10 layers (full, LoRA).

The ``runtime`` runs set :data:`~vpo.memory.CPU_RUNTIME`; every other run checks the plan.

    OMP_NUM_THREADS=1 python benchmarks/memory_plan.py --json runs/bench-memory-plan.json

Measured numbers and the command are in README ("Memory plan"). Peak RSS counts everything the
process touched (allocator arenas, thread pools), so small models read high; the plan's error is
stated per case, not tuned away.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MiB = 2**20

CASES: dict[str, list[str]] = {
    "runtime": ["--layers", "1", "--hidden", "32", "--vocab", "64", "--prompts", "2", "--generations", "2",
                "--prompt-len", "8", "--completion-len", "4"],
    "route": ["--prompts", "8", "--generations", "8", "--prompt-len", "160", "--completion-len", "28"],
    "smollm2": ["--model", "smollm2-135m", "--prompts", "2", "--generations", "4", "--prompt-len", "64",
                "--completion-len", "32"],
    "smollm2-gc": ["--model", "smollm2-135m", "--prompts", "2", "--generations", "4", "--prompt-len", "64",
                   "--completion-len", "32", "--gradient-checkpointing"],
    "smollm2-lora": ["--model", "smollm2-135m", "--prompts", "2", "--generations", "4", "--prompt-len", "64",
                     "--completion-len", "32", "--lora-r", "16"],
    "smollm2-10l": ["--model", "smollm2-135m", "--layers", "10", "--prompts", "2", "--generations", "4",
                    "--prompt-len", "64", "--completion-len", "32"],
    "smollm2-10l-lora": ["--model", "smollm2-135m", "--layers", "10", "--prompts", "2", "--generations", "4",
                         "--prompt-len", "64", "--completion-len", "32", "--lora-r", "16"],
}
CALIBRATION = {("runtime", "grpo"), ("runtime", "vpo")}
"""Runs a plan constant was read from (CPU_RUNTIME): reported, not counted as checks."""


def route_config(folder: Path) -> Path:
    """config.json of the route pipeline's tiny model (what ``vpo stage base`` builds for it)."""
    from vpo.tasks import get_task
    from vpo.tiny import DEFAULT_SIZE, SPECIAL_TOKENS

    task = get_task("route")
    cfg = {"model_type": "llama", "vocab_size": len(SPECIAL_TOKENS) + len(set(task.charset)),
           "tie_word_embeddings": True, **DEFAULT_SIZE}
    path = folder / "route-tiny.json"
    path.write_text(json.dumps(cfg))
    return path


def run_case(name: str, arm: str, extra: list[str], folder: Path, steps: int) -> dict[str, Any]:
    out = folder / f"{name}-{arm}.json"
    args = list(CASES[name])
    if name in ("route", "runtime"):
        args = ["--model", str(route_config(folder)), *args]
    cmd = [sys.executable, str(HERE / "gpu_step.py"), "--engine", "trl", "--device", "cpu", "--arms", arm,
           "--steps", str(steps), "--warmup", "1", "--json", str(out), *args, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name}/{arm} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(out.read_text())
    r = report["arms"][0]
    return {"case": name, "arm": arm, "parameters": report["parameters"], "measured": r["peak_memory"],
            "plan": r["plan_peak"], "ratio": r["plan_over_measured"], "components": r["plan_components"],
            "seconds_per_step": r["seconds_per_step"], "plan_seconds_per_step": r["plan_seconds_per_step"],
            "command": " ".join(cmd[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    ap.add_argument("--arms", nargs="+", default=["grpo", "vpo"])
    ap.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="vpo-memplan-") as tmp:
        for name in args.cases:
            for arm in args.arms:
                row = run_case(name, arm, [], Path(tmp), args.steps)
                row["calibration"] = (name, arm) in CALIBRATION
                rows.append(row)
                print(f"{name:<17}{arm:<6}{row['parameters'] / 1e6:>8.1f}M  plan {row['plan'] / MiB:>7.0f} MiB  "
                      f"measured {row['measured'] / MiB:>7.0f} MiB  plan/measured {row['ratio']:.2f}  "
                      f"step {row['seconds_per_step']:.1f} s (plan {row['plan_seconds_per_step']:.1f} s)", flush=True)
    checked = [r for r in rows if (r["case"], r["arm"]) not in CALIBRATION]
    if checked:
        worst = max(checked, key=lambda r: abs(r["ratio"] - 1))
        print(f"\nworst error over {len(checked)} checked runs: {worst['case']}/{worst['arm']} "
              f"plan/measured {worst['ratio']:.2f}")
    print("\n| case | arm | parameters | plan peak | measured peak | plan / measured | s/step measured | s/step plan |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        role = " (calibration)" if (r["case"], r["arm"]) in CALIBRATION else ""
        print(f"| {r['case']}{role} | {r['arm']} | {r['parameters'] / 1e6:.1f}M | {r['plan'] / MiB:.0f} MiB | "
              f"{r['measured'] / MiB:.0f} MiB | {r['ratio']:.2f} | {r['seconds_per_step']:.2f} | "
              f"{r['plan_seconds_per_step']:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
