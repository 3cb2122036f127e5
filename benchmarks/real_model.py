"""The real-model verdict, one run at a time, kept in the repository: it survives losing the machine.

    python benchmarks/real_model.py run [--pipeline chat-smollm2] [--quick] [--set K=V] [--commit]
    python benchmarks/real_model.py report [--results DIR]

``run`` builds the pipeline's data and warmed base (``vpo stage``; cached stages say ``up to date``),
evaluates the base in each answer format, then trains, evaluates and searches every arm x seed run
whose results are not in the results folder yet -- as many at once as the machine has cores, one
torch thread each -- and writes each finished one to ``benchmarks/results/<variant>/<arm>-s<seed>/``:

* ``eval.json``: best@k, E_w best@k, pass@k, diversity, parse rate (the evaluate stage's metrics of one policy);
* ``vectors.json``: its reward vectors (problems x rollouts x m x d; null = no answer in that slot);
* ``search.json``: the search and best-of-k at the same budget on the same problems, per problem;
* ``curve.json``: the training log per step (reward, parse rate, loss, ...; runs only);
* ``result.json``: written last, the mark of a finished run: the config digest, commit, machine, times.

Never weights. ``--commit`` commits each finished run (``git add`` + ``git commit -- <results dir>``)
in the checkout the script runs in, so a later start -- on this machine or another -- runs only what
is missing (an interrupted training resumes from its checkpoint where the run folder survived, from
step 0 elsewhere). The folder's ``config.json`` holds the settings and their digest: results of other
settings are never mixed in (a different digest is one error naming the settings that differ).

The search ranks its problems by the *base's* evaluation (hardest for the warmed base first), so every
run searches the same problems whatever the other runs' state. ``report`` prints the result table
(mean ± std over seeds), the search table and the missing runs, and draws ``best_at_k.png`` and
``learning_curves.png`` into the results folder, from whatever is there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CONFIG_FILE, RESULT_FILE = "config.json", "result.json"
UNRESULTED = ("storage", "execution")  # where and how runs execute: not what they compute

# ----------------------------------------------------------------------------------- config


def load(args: argparse.Namespace) -> Any:
    """The pipeline config the options name (exit 2 with one ``error:`` line when it is bad)."""
    from vpo.pipeline.cli import load_config

    return load_config(args)


def config_record(cfg: Any) -> dict[str, Any]:
    """What the results depend on: every setting but storage and execution, and its digest."""
    from vpo.pipeline.dvc.params import settings_digest

    settings = {k: v for k, v in cfg.settings().items() if k not in UNRESULTED}
    return {"pipeline": cfg.name, "variant": cfg.variant, "digest": settings_digest({"pipeline": cfg.name,
                                                                                    **settings}),
            "settings": settings, "runs": [r.rid for r in _runs(cfg)],
            "command": [*cfg.cli_args()]}


def _runs(cfg: Any) -> list[Any]:
    from vpo.pipeline.config.layout import arm_runs

    return arm_runs(cfg)


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted keys where two settings mappings differ."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if a == b else [path or "(all)"]


def claim_folder(folder: Path, record: Mapping[str, Any]) -> None:
    """Write ``config.json`` into a new results folder; refuse one that holds other settings' results."""
    path = folder / CONFIG_FILE
    if path.is_file():
        held = json.loads(path.read_text())
        if held.get("digest") != record["digest"]:
            diff = _differences(held.get("settings", {}), record["settings"])[:8]
            raise SystemExit(f"error: {folder} holds results of other settings (digest {held.get('digest')} there, "
                             f"{record['digest']} now; differing: {', '.join(diff) or 'pipeline'}): pass --results "
                             "with a new folder, or remove that one to start over")
        return
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(path, record)


def _write_json(path: Path, data: Any) -> None:
    from vpo.atomic import atomic_write_json

    atomic_write_json(path, data)


def finished(folder: Path, name: str, digest: str) -> bool:
    """Whether ``folder/name`` holds a finished result of these settings (its result.json, written last)."""
    path = folder / name / RESULT_FILE
    if not path.is_file():
        return False
    return json.loads(path.read_text()).get("digest") == digest


# ----------------------------------------------------------------------------------- one job


def _vectors_json(vectors: np.ndarray) -> list[Any]:
    return np.where(np.isnan(vectors), None, vectors).tolist()


def _vectors_array(data: Any) -> np.ndarray:
    return np.array(data, dtype=np.float64)


def _machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "host": platform.node(), "python": platform.python_version()}


def _commit() -> str | None:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _base_digest(layout: Any) -> str | None:
    weights = sorted(layout.base.glob("*.safetensors"))
    return _file_digest(weights[0]) if weights else None


def _vpo(cfg: Any, *argv: str, threads: int) -> None:
    """One ``vpo`` command on this config in a child process (one ``threads``-thread slot)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "VPO_STAGE_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "vpo.pipeline.cli", *argv, *cfg.cli_args()]
    code = _wait(_start(cmd, env))
    if code != 0:
        raise SystemExit(f"error: `vpo {' '.join(argv)}` exited with {code}")


def _start(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[Any]:
    """A child in its own process group, registered so that a signal to this process stops it (and
    whatever it started) before this process exits: nothing keeps training after the driver is gone."""
    from vpo.pipeline.engine.processes import track

    return track(subprocess.Popen(list(cmd), cwd=REPO, env=dict(env), start_new_session=True))


def _wait(proc: subprocess.Popen[Any]) -> int:
    from vpo.pipeline.engine.processes import untrack

    try:
        return proc.wait()
    finally:
        untrack(proc)


def job(cfg: Any, folder: Path, name: str, threads: int) -> None:
    """Compute and write one result: ``base-m<m>`` (evaluation) or an arm run (train, evaluate, search)."""
    import torch
    from transformers.utils import logging as hf_logging

    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.context import build_task
    from vpo.pipeline.stages.evaluate import eval_rows, evaluate_one, policies

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # weight-loading bars of every policy load
    record = json.loads((folder / CONFIG_FILE).read_text())
    layout, task = RunLayout.of(cfg), build_task(cfg)
    out = folder / name
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    run = next((r for r in _runs(cfg) if r.rid == name), None)
    if run is not None:
        with _timed(times, "train"):
            _vpo(cfg, "stage", "train", "--arm", run.arm.name, "--seed", str(run.seed), threads=threads)
        history = layout.arm_history(name)
        _write_json(out / "curve.json", json.loads(history.read_text()))
    policy = next(p for p in policies(cfg, layout) if p.rid == name)
    rows = eval_rows(cfg, layout)
    with _timed(times, "evaluate"):
        res, vectors = evaluate_one(cfg, task, rows, policy)
    _write_json(out / "eval.json", res)
    _write_json(out / "vectors.json", _vectors_json(vectors))
    if run is not None and cfg.search is not None and cfg.search.enabled:
        with _timed(times, "search"):
            _write_json(out / "search.json", _search(cfg, layout, task, rows, run, folder))
    metrics = layout.arm_metrics(name)
    _write_json(out / RESULT_FILE, {
        "name": name, "digest": record["digest"], "variant": cfg.variant, "commit": _commit(), "machine": _machine(),
        "threads": threads, "times": times, "base_weights": _base_digest(layout),
        "train": json.loads(metrics.read_text()) if run is not None and metrics.is_file() else None,
        "load_at_finish": [round(x, 2) for x in os.getloadavg()], "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


@contextmanager
def _timed(times: dict[str, float], phase: str) -> Iterator[None]:
    """Record ``<phase>_s`` (wall seconds) and ``<phase>_cpu_s`` (CPU seconds of this process and of the
    children it waited for: the train stage's process) of the block in ``times``."""
    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    w0, c0 = time.time(), cpu()
    yield
    times[f"{phase}_s"] = round(time.time() - w0, 1)
    times[f"{phase}_cpu_s"] = round(cpu() - c0, 1)


def _search(cfg: Any, layout: Any, task: Any, rows: Sequence[Mapping[str, Any]], run: Any,
            folder: Path) -> dict[str, Any]:
    """The run's search and best-of-k on the problems the warmed base finds hardest."""
    from vpo.pipeline.stages.search import arm_proposer, search_budget, search_options, select_problems
    from vpo.search import search_arm

    sc = cfg.search
    ev = cfg.evaluation
    base = {name: _vectors_array(json.loads((folder / name / "vectors.json").read_text()))
            for name in _base_names(cfg)}
    k_max = max(ev.k)
    selected, hard = select_problems(task, rows, base, k_max, ev.pool, sc.n_problems)
    m_of, budget = search_budget(cfg)
    ck = layout.root / "real-model-search" / run.rid
    results = search_arm(selected, task, run.rid, arm_proposer(cfg, task, run, layout.arm_model(run.rid)), ck,
                         m=m_of[run.arm.name], budget=budget, **search_options(cfg))
    return {"problems": [str(r["id"]) for r in selected], "hardest_for_base": hard, "ranked_by": sorted(base),
            "k_max": k_max, "budget": budget, "m": m_of[run.arm.name],
            "results": {key: [r.to_dict() for r in rs] for key, rs in results.items()}}


def _base_names(cfg: Any) -> list[str]:
    return [f"base-m{m}" for m in sorted({a.num_answers for a in cfg.enabled_arms})]


# ----------------------------------------------------------------------------------- the driver


def _git_commit(folder: Path, message: str, attempts: int = 5, pause: float = 2.0) -> bool:
    """Commit ``folder`` (only it) in this checkout. A failure -- another git command holding the index
    lock, say -- is retried, then reported, never fatal: the files stay in the folder and the next start
    commits them (it adds the whole results folder)."""
    rel = os.path.relpath(folder, REPO)
    error = ""
    for attempt in range(attempts):
        try:
            _git("add", "--", rel)
            if subprocess.run(["git", "-C", str(REPO), "diff", "--cached", "--quiet", "--", rel],
                              check=False).returncode == 0:
                return True  # nothing new
            _git("commit", "-q", "-m", message, "--", rel)
            print(f"[real-model] committed {rel}: {message}", flush=True)
            return True
        except subprocess.CalledProcessError as exc:
            lines = (exc.stderr or "").strip().splitlines()
            error = lines[-1] if lines else f"exit {exc.returncode}"
            time.sleep(pause * (attempt + 1))
    print(f"[real-model] warning: could not commit {rel} ({error}); it is kept there, and the next start "
          "commits it", flush=True)
    return False


def _git(*argv: str) -> None:
    subprocess.run(["git", "-C", str(REPO), *argv], check=True, capture_output=True, text=True)


def _job_argv(cfg: Any, folder: Path, name: str, threads: int) -> list[str]:
    """The command that computes one result in a child process, on the very config ``cfg``."""
    return [sys.executable, str(Path(__file__).resolve()), "job", name, "--results", str(folder),
            "--threads", str(threads), *cfg.cli_args()]


def _run_jobs(cfg: Any, names: list[str], slots: int, threads: int, folder: Path, on_done: Any) -> None:
    """Run the named jobs as child processes, ``slots`` at once; stop launching at the first failure."""
    pending, running, failed = list(names), {}, []
    try:
        while pending or running:
            while pending and len(running) < slots and not failed:
                name = pending.pop(0)
                print(f"[real-model] {name}: starting", flush=True)
                env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
                running[name] = (_start(_job_argv(cfg, folder, name, threads), env), time.time())
            if not running:
                break
            time.sleep(2)
            for name, (proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                _wait(proc)
                minutes = (time.time() - t0) / 60
                if proc.returncode == 0:
                    print(f"[real-model] {name}: done in {minutes:.1f} min", flush=True)
                    on_done(name)
                else:
                    print(f"[real-model] {name}: failed (exit {proc.returncode}) after {minutes:.1f} min", flush=True)
                    failed.append(name)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: the signal handler has stopped the jobs
        from vpo.pipeline.engine.processes import describe

        print(f"[real-model] {describe(exc)}: {', '.join(running) or 'no job'} stopped; run the same command again "
              "to continue with what is missing (training resumes from its newest checkpoint)", flush=True)
        raise
    except BaseException:  # a bug here: no job keeps running without the driver
        from vpo.pipeline.engine.processes import stop_all

        stop_all()
        raise
    if failed:
        raise SystemExit(f"error: {', '.join(failed)} failed (their output is above); the finished runs are kept")


def run(args: argparse.Namespace) -> None:
    """Prepare the base, then every missing result."""
    from vpo.pipeline.engine.execution import Machine

    cfg = load(args)
    record = config_record(cfg)
    folder = Path(args.results or RESULTS / cfg.variant).resolve()
    claim_folder(folder, record)
    names = _base_names(cfg) + record["runs"]
    have = [n for n in names if finished(folder, n, record["digest"])]
    todo = [n for n in names if n not in have]
    print(f"[real-model] {cfg.variant} (config {record['digest']}): {len(have)} of {len(names)} results in {folder}"
          + (f"; to do: {', '.join(todo)}" if todo else "; nothing to do"), flush=True)
    if args.commit:
        _git_commit(folder, f"Real-model results: {cfg.variant} settings (config {record['digest']})")
    if not todo:
        return
    cores = Machine.detect().cores
    slots = max(1, min(args.jobs or cores, cores))
    threads = max(1, cores // slots)
    for stage in ("data", "rewards", "base"):
        _vpo(cfg, "stage", stage, threads=cores)

    def done(name: str) -> None:
        if args.commit:
            _git_commit(folder / name, f"Real-model results: {name} ({cfg.variant}, config {record['digest']})")

    bases = [n for n in todo if n.startswith("base-")]
    _run_jobs(cfg, bases, slots, threads, folder, done)  # the runs' searches rank problems by the base's results
    _run_jobs(cfg, [n for n in todo if n not in bases], slots, threads, folder, done)
    print("[real-model] every result is in; `python benchmarks/real_model.py report` prints the tables", flush=True)


# ----------------------------------------------------------------------------------- the report


def _mean_std(values: Sequence[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if values else "n/a"


def search_rows(folder: Path, runs: Sequence[str]) -> list[str]:
    """Markdown rows: per arm, the search and its best-of-k at the same budget (mean ± std over seeds)."""
    from vpo.search.curves import search_curves
    from vpo.search.runner import BASELINE_SUFFIX

    per_arm: dict[str, list[dict[str, Any]]] = {}
    meta: dict[str, Any] = {}
    for rid in runs:
        path = folder / rid / "search.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        meta = data
        curves = search_curves(data["results"])
        per_arm.setdefault(rid.rsplit("-s", 1)[0], []).append(
            {"search": curves[rid], "best_of_k": curves[rid + BASELINE_SUFFIX]})
    if not per_arm:
        return []
    n = len(meta["problems"])
    lines = [(f"Search on {n} held-out problems (the {len(meta['hardest_for_base'])} the warmed base never solves at "
             f"best@{meta['k_max']} first), {meta['budget']} answer slots per problem for the search and for "
             "best-of-k alike; solved = the problem's best achievable score reached; mean ± std over seeds."), "",
             "| arm | seeds | search: solved | best-of-k: solved | search: mean best | best-of-k: mean best |",
             "|---|---|---|---|---|---|"]
    for arm, recs in per_arm.items():
        cells = [_mean_std([r[kind]["final_solved"] for r in recs]) for kind in ("search", "best_of_k")]
        cells += [_mean_std([r[kind]["final_mean_best"] for r in recs]) for kind in ("search", "best_of_k")]
        lines.append(f"| {arm} | {len(recs)} | " + " | ".join(cells) + " |")
    return lines


def curve_rows(histories: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], window: int = 10) -> list[str]:
    """Markdown rows: per arm, the training reward and parse rate over the first and the last ``window``
    logged steps (mean ± std over seeds)."""
    def span(rec: Sequence[Mapping[str, Any]], key: str, last: bool) -> float:
        vals = [float(r[key]) for r in rec if r.get(key) is not None and "step" in r]
        part = vals[-window:] if last else vals[:window]
        return float(np.mean(part)) if part else float("nan")

    lines = [(f"| arm | seeds | steps | reward, first {window} | reward, last {window} | parsed, first {window} | "
             f"parsed, last {window} |"), "|---|---|---|---|---|---|---|"]
    for arm, runs in histories.items():
        steps = max(max((r.get("step") or 0 for r in rec), default=0) for rec in runs)
        cells = [_mean_std([span(rec, "reward", last) for rec in runs]) for last in (False, True)]
        cells += [_mean_std([1.0 - span(rec, "vpo/frac_unparsed", last) for rec in runs]) for last in (False, True)]
        lines.append(f"| {arm} | {len(runs)} | {steps} | " + " | ".join(cells) + " |")
    return lines


def report(args: argparse.Namespace) -> str:
    """Print (and write as ``table.md``) what the results folder holds; draw its plots."""
    from vpo.pipeline.stages.evaluate import aggregate_runs, plot_best_at_k, results_table
    from vpo.plots import learning_curves

    folder = Path(args.results or RESULTS / "chat-smollm2").resolve()
    if not (folder / CONFIG_FILE).is_file():
        raise SystemExit(f"error: {folder} holds no {CONFIG_FILE}: no results yet (`python benchmarks/real_model.py "
                         "run` makes them)")
    record = json.loads((folder / CONFIG_FILE).read_text())
    digest, runs = record["digest"], record["runs"]
    ev = record["settings"]["evaluation"]
    names = sorted({n for n in os.listdir(folder) if (folder / n).is_dir()})
    bases = [n for n in names if n.startswith("base-")]
    present = [n for n in bases + runs if finished(folder, n, digest)]
    missing = [n for n in runs if n not in present]
    per_run = {n: json.loads((folder / n / "eval.json").read_text()) for n in present}
    groups: dict[str, list[str]] = {}
    for n in present:
        groups.setdefault(n if n.startswith("base-") else n.rsplit("-s", 1)[0], []).append(n)
    lines = [f"# Real model: {record['variant']} (config {digest})", ""]
    if per_run:
        base_div = [r["reward_diversity"] for n, r in per_run.items() if n.startswith("base")]
        agg = aggregate_runs(per_run, groups, collapse_threshold=0.1 * max(base_div) if base_div else 0.1)
        ks = [k for k in ev["k"] if all(str(k) in r["best_at_k"] for r in per_run.values())]
        lines += [(f"Held-out `{ev['split']}` problems: {next(iter(per_run.values()))['n_problems']}; "
                  f"{ev['n_samples']} candidates per problem."), "", results_table(agg, ks, ev["pool"]).rstrip()]
        plot_best_at_k(agg, ks, folder / "best_at_k.png", f"{record['variant']}: held-out {ev['split']}")
    lines += ["", *search_rows(folder, [n for n in runs if n in present])]
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    for n in runs:
        if n in present and (folder / n / "curve.json").is_file():
            histories.setdefault(n.rsplit("-s", 1)[0], []).append(json.loads((folder / n / "curve.json").read_text()))
    if histories:
        steps = max(len(h) for hs in histories.values() for h in hs)
        learning_curves(histories, folder / "learning_curves.png", f"{record['variant']}: training",
                        smooth=max(1, min(10, steps // 20)))
        lines += ["", "Training (the per-step curves: learning_curves.png):", "", *curve_rows(histories)]
    lines += ["", f"Runs: {len(runs) - len(missing)} of {len(runs)} finished"
              + (f"; missing: {', '.join(missing)}" if missing else "") + "."]
    text = "\n".join(lines).rstrip() + "\n"
    (folder / "table.md").write_text(text)
    print(text, end="")
    print(f"plots: {folder / 'best_at_k.png'}, {folder / 'learning_curves.png'}")
    return text


def parser() -> argparse.ArgumentParser:
    """The command line: ``run``, ``report`` and the internal ``job``."""
    from vpo.pipeline.cli import add_common_options

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="compute every missing result (base evaluation, then the runs)")
    add_common_options(p_run)
    p_run.add_argument("--results", default=None, help="results folder (default: benchmarks/results/<variant>)")
    p_run.add_argument("--jobs", type=int, default=None, help="results computed at once (default: the cores)")
    p_run.add_argument("--commit", action="store_true", help="git-commit each finished result in this checkout")
    p_job = sub.add_parser("job", help="(internal) compute one result")
    add_common_options(p_job)
    p_job.add_argument("name")
    p_job.add_argument("--results", required=True)
    p_job.add_argument("--threads", type=int, default=1)
    p_rep = sub.add_parser("report", help="print the tables and draw the plots from the results folder")
    p_rep.add_argument("--results", default=None, help="results folder (default: benchmarks/results/chat-smollm2)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.cmd == "report":
        report(args)
        return
    if args.pipeline is None and args.variant is None:
        args.pipeline = "chat-smollm2"
    from vpo.pipeline.engine.processes import exit_code, stop_on_signals

    try:
        with stop_on_signals():  # SIGTERM and SIGHUP as Ctrl-C: the children first, then this process
            if args.cmd == "run":
                run(args)
            else:
                job(load(args), Path(args.results), args.name, args.threads)
    except KeyboardInterrupt as exc:
        raise SystemExit(exit_code(exc)) from None


if __name__ == "__main__":
    main()
