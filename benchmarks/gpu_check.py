"""The GPU check's runner: each check is one ``benchmarks/gpu_step.py`` run in its own process (the
step at a few shapes, the training step alone at a preset arm's shape, one-process ``accelerate launch``
runs of the manual engine under FSDP and DeepSpeed ZeRO-2); their reports go into one JSON and one
markdown table. ``benchmarks/gpu_check.sh`` installs what the machine lacks and calls this; a check
that fails makes the exit status non-zero with one line naming it.

    python benchmarks/gpu_check.py --out runs/gpu-check                 # GPU, full sizes
    python benchmarks/gpu_check.py --out runs/gpu-check --cpu --tiny    # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # a checkout's own vpo, installed or not

from vpo.requirements import installed_version

STEP = "benchmarks/gpu_step.py"
BUDGET = 480.0
"""Seconds the whole check may take on one H200-class GPU."""
SCALE = ("--layers", "1", "--hidden", "32", "--vocab", "128", "--threads", "1")
"""Tiny sizes: the architecture scaled to one layer of width 32 (the preset check scales the preset's model)."""
TINY = ("--model", "smollm2-135m", *SCALE)
LIBRARIES = ("torch", "transformers", "accelerate", "peft", "deepspeed", "trl", "vllm", "numpy", "vpo")


@dataclass(frozen=True)
class Check:
    """One check: a name, the gpu_step arguments, the accelerate config it is launched under (None: a
    plain ``python`` run) and the distributed type that launch must give on a GPU; ``cpu`` False: it
    cannot run on a CPU (said in the report, with why); ``needs``: modules it imports beyond the base."""

    name: str
    args: tuple[str, ...]
    launch: str | None = None
    expect: str | None = None
    cpu: bool = True
    why_not_cpu: str = ""
    needs: tuple[str, ...] = field(default=())


def checks(device: str, tiny: bool) -> list[Check]:
    """The checks of one run: full sizes on a GPU, or the same checks at tiny sizes."""
    small = TINY if tiny else ()
    dev = ("--device", device, "--engine", "manual")
    fast = ("--steps", "1", "--warmup", "1") if tiny else ("--steps", "2", "--warmup", "1")
    if tiny:
        shapes = [
            Check("step-short", (*small, *dev, *fast, "--arms", "grpo", "vpo", "--prompts", "2", "--generations", "2",
                                 "--prompt-len", "8", "--completion-len", "6")),
            Check("step-lora-ckpt", (*small, *dev, *fast, "--arms", "vpo", "--prompts", "2", "--generations", "2",
                                     "--prompt-len", "8", "--completion-len", "4", "--lora-r", "4",
                                     "--gradient-checkpointing", "--micro-batch", "2"), needs=("peft",)),
        ]
        preset = (*SCALE, "--prompts", "1", "--prompt-len", "16", "--completion-total", "24")
        launched = (*small, "--prompts", "1", "--generations", "2", "--prompt-len", "8", "--completion-len", "4")
    else:
        shapes = [
            Check("step-0.5b", ("--model", "qwen2.5-0.5b", *dev, *fast, "--arms", "grpo", "vpo", "--prompts", "8",
                                "--generations", "8", "--prompt-len", "256", "--completion-len", "128")),
            Check("step-0.5b-long-ckpt", ("--model", "qwen2.5-0.5b", *dev, *fast, "--arms", "grpo", "vpo",
                                          "--prompts", "4", "--generations", "8", "--prompt-len", "1024",
                                          "--completion-len", "256", "--gradient-checkpointing",
                                          "--micro-batch", "8")),
            Check("step-1.5b-lora", ("--model", "qwen2.5-1.5b", *dev, *fast, "--arms", "vpo", "--prompts", "4",
                                     "--generations", "8", "--prompt-len", "512", "--completion-len", "128",
                                     "--lora-r", "32", "--gradient-checkpointing"), needs=("peft",)),
        ]
        preset = ()
        launched = ("--model", "qwen2.5-0.5b", "--prompts", "2", "--generations", "4", "--prompt-len", "512",
                    "--completion-len", "256")
    one = ("--steps", "1", "--warmup", "1")
    return [
        *shapes,
        Check("train-only-code-qwen-1gpu-lora-vpo", (*preset, *dev, *one, "--train-only", "--preset",
                                                     "code-qwen-1gpu-lora", "--arm", "vpo"), needs=("peft",)),
        Check("accelerate-fsdp2", (*launched, "--device", device, *one, "--arms", "vpo", "--train-only",
                                   "--accelerate"), launch="infra/accelerate/fsdp.yaml", expect="FSDP"),
        Check("accelerate-deepspeed-zero2", (*launched, "--device", device, *one, "--arms", "vpo", "--train-only",
                                             "--accelerate"), launch="infra/accelerate/deepspeed_zero2.yaml",
              expect="DEEPSPEED", cpu=False, why_not_cpu="GPU only (DeepSpeed's CPU accelerator is not what the presets run; not tried with --cpu)",
              needs=("deepspeed",)),
    ]


def command(check: Check, python: str, part: Path, device: str) -> list[str]:
    """The command line of one check, writing its report to ``part``."""
    step = [STEP, *check.args, "--json", str(part)]
    if check.launch is None:
        return [python, *step]
    launch = [python, "-m", "accelerate.commands.launch", "--config_file", check.launch, "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "bf16" if device == "cuda" else "no"]
    return [*launch, *step]


def versions() -> dict[str, str | None]:
    """This interpreter's library versions (the report's, when no check ran to say them)."""
    return {"python": sys.version.split()[0], **{name: installed_version(name) for name in LIBRARIES}}


def run_check(check: Check, python: str, out: Path, device: str, timeout: float) -> dict[str, Any]:
    """Run one check in its own process group; its log and report go under ``out``."""
    part, log = out / "parts" / f"{check.name}.json", out / "logs" / f"{check.name}.log"
    part.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    part.unlink(missing_ok=True)
    cmd = command(check, python, part, device)
    entry: dict[str, Any] = {"name": check.name, "command": " ".join(cmd), "log": str(log.relative_to(out))}
    if device == "cpu" and not check.cpu:
        return {**entry, "status": "not run", "seconds": 0.0, "error": check.why_not_cpu}
    missing = [m for m in check.needs if not _importable(python, m)]
    if missing:
        return {**entry, "status": "failed", "seconds": 0.0, "error": f"{', '.join(missing)} not importable"}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    seconds = round(time.perf_counter() - t0, 2)
    if rc is None:
        return {**entry, "status": "failed", "seconds": seconds, "error": f"timed out after {timeout:.0f} s"}
    if rc != 0 or not part.is_file():
        return {**entry, "status": "failed", "seconds": seconds, "error": _last_error(log, rc)}
    report = json.loads(part.read_text())
    ran_as = report["arms"][0].get("accelerate")
    if check.launch is not None:
        entry["distributed_type"] = ran_as
        if device == "cpu":  # accelerate runs one CPU process plainly: the launch path, not FSDP itself
            entry["note"] = f"on the CPU accelerate runs one process as {ran_as}, not {check.expect}"
        elif ran_as != check.expect:
            return {**entry, "status": "failed", "seconds": seconds, "report": report,
                    "error": f"accelerate ran it as {ran_as}, not {check.expect}"}
    return {**entry, "status": "ok", "seconds": seconds, "report": report}


def _importable(python: str, module: str) -> bool:
    import importlib.util

    if python == sys.executable:
        return importlib.util.find_spec(module) is not None
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], check=False, capture_output=True).returncode == 0


def _last_error(log: Path, rc: int | None) -> str:
    """The last line of the log that says what went wrong (or the exit status)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("error:", "Error", "RuntimeError", "ValueError", "ImportError", "ModuleNotFoundError",
                          "AssertionError", "TypeError", "AttributeError", "OSError", "torch.")) \
                or "Error:" in ln or " error: " in ln:
            return ln[:400]
    return f"exit status {rc}" + (f": {lines[-1][:300]}" if lines else "")


# --------------------------------------------------------------------------------------- the report


def _mib(n: Any) -> str:
    return f"{n / 2**20:,.0f}" if isinstance(n, (int, float)) else "-"


def _num(x: Any, fmt: str = "{:.3g}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def markdown(report: Mapping[str, Any]) -> str:
    """One table: a row per check and arm (a failed or not-run check: one row saying so)."""
    head = (f"GPU check, {report['mode']}: {report['device']}; {report['matmul']}; "
            f"{report['seconds']:.0f} s of a {report['budget_seconds']:.0f} s budget; "
            + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v) + "\n\n")
    rows = [("| check | arm | shape | s/step | generation s | training s | training TFLOP/s | MFU "
             "| peak MiB | max reserved MiB | plan MiB | plan / measured |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["checks"]:
        if c["status"] != "ok":
            rows.append(f"| {c['name']} | - | {c['status']}: {c['error']} | - | - | - | - | - | - | - | - | - |")
            continue
        r = c["report"]
        for a in r["arms"]:
            shape = (f"{r['model']}, {a['sequences_per_step']} x ({a['prompt_tokens']} + {a['completion_tokens']}), "
                     f"micro {a['micro_batch']}" + (f", {a['accelerate']}" if a.get("accelerate") else "")
                     + (", train only" if a["mode"] == "train-only" else ""))
            measured = a["max_memory_allocated"] if a["max_memory_allocated"] is not None else a["peak_memory"]
            reserved = a["max_memory_reserved"]
            rows.append(f"| {c['name']} | {a['arm']} (m={a['m']}) | {shape} | {a['seconds_per_step']:.3f} "
                        f"| {a['generation_seconds']:.3f} | {a['training_seconds']:.3f} "
                        f"| {_num(a['achieved_tflops']['training'])} | {_num(a['mfu']['training'], '{:.1%}')} "
                        f"| {_mib(measured)} | {_mib(reserved)} | {_mib(a['plan_peak'])} "
                        f"| {_num(a['plan_over_measured'])} |")
    failed = [c for c in report["checks"] if c["status"] == "failed"]
    tail = ("\n\npeak: torch.cuda.max_memory_allocated on CUDA, peak RSS above the RSS before the model on the CPU; "
            "MFU: training TFLOP/s (the plan's FLOPs of the step over its training seconds) / the matmul's.\n\n"
            + ("All checks passed." if not failed else f"{len(failed)} check(s) FAILED.") + "\n")
    return head + "\n".join(rows) + tail


def build_report(results: Sequence[Mapping[str, Any]], *, device: str, tiny: bool, seconds: float,
                 wheels: Sequence[Mapping[str, Any]], budget: float) -> dict[str, Any]:
    ok = [c for c in results if c["status"] == "ok"]
    first = ok[0]["report"] if ok else {}
    matmul = first.get("matmul")
    return {"mode": f"{device}{' tiny' if tiny else ''}", "device": first.get("device", device),
            "gpu": first.get("gpu"), "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(seconds, 1), "budget_seconds": budget, "within_budget": seconds <= budget,
            "matmul": (f"{matmul['dtype']} matmul {matmul['tflops']:.4g} TFLOP/s (n = {matmul['n']})" if matmul
                       else "no matmul measured"),
            "versions": first.get("versions") or versions(), "wheels": list(wheels), "checks": list(results),
            "passed": all(c["status"] != "failed" for c in results)}


def read_wheels(manifest: Path | None) -> list[dict[str, Any]]:
    """The wheels ``gpu_check.sh`` installed (name and bytes), from its manifest (one ``name size`` a line)."""
    if manifest is None or not manifest.is_file():
        return []
    out = []
    for line in manifest.read_text().splitlines():
        name, _, size = line.rpartition(" ")
        if name:
            out.append({"wheel": name, "bytes": int(size)})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (tiny sizes make sense here)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and shapes (seconds each)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the checks run under")
    ap.add_argument("--only", nargs="+", default=None, help="run these checks only (names as in the report)")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds for all checks (each gets what is left)")
    ap.add_argument("--wheels-manifest", default=None, help="what gpu_check.sh installed (for the report)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = checks(device, args.tiny)
    if args.only:
        unknown = set(args.only) - {c.name for c in todo}
        if unknown:
            ap.error(f"unknown check {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in todo)}")
        todo = [c for c in todo if c.name in args.only]
    t0 = time.perf_counter()
    results = []
    for check in todo:
        left = args.budget - (time.perf_counter() - t0)
        print(f"gpu-check: {check.name} ...", file=sys.stderr, flush=True)
        result = run_check(check, args.python, out, device, timeout=left)
        print(f"gpu-check: {check.name}: {result['status']} ({result['seconds']:.1f} s)"
              + (f": {result['error']}" if result["status"] != "ok" else ""), file=sys.stderr, flush=True)
        results.append(result)
    report = build_report(results, device=device, tiny=args.tiny, seconds=time.perf_counter() - t0,
                          wheels=read_wheels(Path(args.wheels_manifest) if args.wheels_manifest else None),
                          budget=args.budget)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report)
    (out / "gpu-check.md").write_text(table)
    print(table)
    failed = [c for c in results if c["status"] == "failed"]
    for c in failed:
        print(f"error: gpu check {c['name']} failed: {c['error']} (log: {out / c['log']})", file=sys.stderr)
    if not report["within_budget"]:
        print(f"error: the checks took {report['seconds']:.0f} s, over the {args.budget:.0f} s budget", file=sys.stderr)
    return 1 if failed or not report["within_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
