"""Bridge to OpenEvolve (optional extra ``vpo[openevolve]``, ``openevolve==0.4.0``) for GPU users.

Recipe: serve a checkpoint with vLLM's OpenAI-compatible server (:func:`vllm_serve_command` /
:class:`VLLMServer`), then :func:`run_openevolve` writes

* ``evaluator.py``: the module OpenEvolve loads; ``evaluate(program_path)`` scores the program
  with the task's vector reward and returns ``combined_score`` (= w*·r over present dimensions),
  ``solved`` and one metric per present reward dimension (``v_<name>``);
* ``problem.pkl``: the problem row (and the reward object, unless the task is given by its
  registered name so a worker process can rebuild it);
* ``config.yaml``: ``llm.api_base`` pointing at the server, full-rewrite evolution, no cascade,
  and the reward dimensions as MAP-Elites ``database.feature_dimensions`` (OpenEvolve bins the
  raw values itself; per-test pass rates need 2 bins, continuous scores more);
* ``initial_program.py``: the starting program;

and runs ``openevolve.run_evolution``. OpenEvolve takes ONE program per LLM reply, so a run of
``iterations`` iterations evaluates ``iterations`` candidates (200 x 3 in our own loop
corresponds to ``iterations=600`` here); our :func:`vpo.search.run_search` is the harness that
asks for m candidates per call.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from vpo.rewards import validate_reward_matrix
from vpo.search.database import scalarize
from vpo.search.loop import solved_checker

__all__ = [
    "OPENEVOLVE_MISSING",
    "VLLMServer",
    "evaluate_program",
    "feature_names",
    "program_text",
    "prompt_text",
    "run_openevolve",
    "vllm_serve_command",
    "wait_for_server",
    "write_evaluator",
    "write_openevolve_config",
]

OPENEVOLVE_MISSING = (
    "OpenEvolve is not installed. It is an optional extra: pip install 'vpo[openevolve]' "
    "(openevolve==0.4.0). Without it, use vpo.search.run_search with an OpenAIProposer."
)
_MARKER = re.compile(r"^\s*#\s*EVOLVE-BLOCK-(START|END)\s*$")
_SOLVED_TOL = 1e-9


def feature_names(reward: Any, row: Mapping[str, Any]) -> list[str]:
    """Metric names (``v_<sanitised name>``) of the reward dimensions present for ``row``."""
    present = np.asarray(reward.present(row), dtype=bool)
    names: list[str] = []
    for i, name in enumerate(reward.names):
        if not present[i]:
            continue
        base = "v_" + (re.sub(r"\W+", "_", str(name)).strip("_") or f"d{i}")
        names.append(base if base not in names else f"{base}_{i}")
    return names


def program_text(program_path: str | os.PathLike[str]) -> str:
    """The candidate inside an OpenEvolve program file, EVOLVE-BLOCK marker lines removed."""
    text = Path(program_path).read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not _MARKER.match(line)).strip("\n")


def _load_spec(spec_path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    if spec.get("task_name"):
        from vpo.tasks import get_task

        task = get_task(spec["task_name"], **(spec.get("task_params") or {}))
        spec["reward"] = task.reward
        spec["solved"] = solved_checker(task, spec["row"])
    else:
        target = float(spec.get("solved_threshold", 1.0))
        spec["solved"] = lambda v, s: s >= target - _SOLVED_TOL
    return spec


_SPEC_CACHE: dict[str, dict[str, Any]] = {}


def evaluate_program(
    program_path: str | os.PathLike[str], spec_path: str | os.PathLike[str]
) -> dict[str, Any]:
    """OpenEvolve metrics for one program file: ``combined_score``, ``solved`` and each present
    reward dimension; a scoring failure gives zeros plus an ``error`` string."""
    key = str(Path(spec_path).resolve())
    if key not in _SPEC_CACHE:
        _SPEC_CACHE[key] = _load_spec(spec_path)
    spec = _SPEC_CACHE[key]
    reward, row = spec["reward"], spec["row"]
    feats = feature_names(reward, row)
    present = np.asarray(reward.present(row), dtype=bool)
    try:
        answer = program_text(program_path)
        if not answer.strip():
            raise ValueError("empty program")
        vec = validate_reward_matrix(reward.score([answer], row), 1, present, "openevolve evaluator")[0]
    except Exception as exc:  # noqa: BLE001 - an evaluator must report, not crash the run
        return {
            "combined_score": 0.0,
            "solved": 0.0,
            **{f: 0.0 for f in feats},
            "error": f"{type(exc).__name__}: {exc}",
        }
    score = scalarize(vec, reward.w_star())
    solved = bool(spec["solved"](vec, score))
    metrics: dict[str, Any] = {"combined_score": float(score), "solved": float(solved)}
    metrics.update({f: float(v) for f, v in zip(feats, vec[present])})
    return metrics


_EVALUATOR_TEMPLATE = '''"""OpenEvolve evaluator generated by vpo.search.openevolve_bridge (do not edit)."""

from vpo.search.openevolve_bridge import evaluate_program

SPEC_PATH = {spec!r}
FEATURES = {features!r}


def evaluate(program_path):
    """Score one program with the task's vector reward."""
    return evaluate_program(program_path, SPEC_PATH)
'''


def write_evaluator(
    work_dir: str | os.PathLike[str],
    reward: Any,
    row: Mapping[str, Any],
    *,
    task_name: str | None = None,
    task_params: Mapping[str, Any] | None = None,
    solved_threshold: float = 1.0,
) -> Path:
    """Write ``evaluator.py`` + ``problem.pkl`` into ``work_dir``; returns the evaluator path.

    With ``task_name`` the evaluator rebuilds the task via ``vpo.tasks.get_task`` (safe in
    OpenEvolve's worker processes) and decides "solved" like the search loop
    (:func:`~vpo.search.loop.solved_checker`); otherwise the reward object itself is pickled and
    a program is solved when its scalar reaches ``solved_threshold``.
    """
    wd = Path(work_dir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = {
        "row": dict(row),
        "task_name": task_name,
        "task_params": dict(task_params or {}),
        "solved_threshold": float(solved_threshold),
    }
    if not task_name:
        spec["reward"] = reward
    spec_path = wd / "problem.pkl"
    with open(spec_path, "wb") as f:
        pickle.dump(spec, f)
    ev = wd / "evaluator.py"
    ev.write_text(
        _EVALUATOR_TEMPLATE.format(spec=str(spec_path), features=feature_names(reward, row)), encoding="utf-8"
    )
    _SPEC_CACHE.pop(str(spec_path), None)
    return ev


def write_openevolve_config(
    path: str | os.PathLike[str],
    *,
    api_base: str,
    model: str,
    feature_dimensions: Sequence[str],
    iterations: int = 600,
    seed: int = 0,
    api_key: str = "EMPTY",
    system_message: str | None = None,
    temperature: float = 1.0,
    max_tokens: int = 2048,
    timeout: int = 600,
    num_islands: int = 4,
    feature_bins: int | Mapping[str, int] = 2,
    migration_interval: int = 20,
    migration_rate: float = 0.1,
    population_size: int = 1000,
    checkpoint_interval: int = 50,
    language: str = "python",
    eval_timeout: int = 60,
    parallel_evaluations: int = 1,
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write an OpenEvolve YAML config (full-rewrite evolution, our reward dims as features)."""
    import yaml

    cfg: dict[str, Any] = {
        "max_iterations": int(iterations),
        "checkpoint_interval": int(checkpoint_interval),
        "random_seed": int(seed),
        "language": language,
        "diff_based_evolution": False,
        "llm": {
            "api_base": api_base,
            "api_key": api_key,
            "models": [{"name": model, "weight": 1.0}],
            "temperature": float(temperature),
            "max_tokens": int(max_tokens),
            "timeout": int(timeout),
            "random_seed": int(seed),
        },
        "prompt": {},
        "database": {
            "num_islands": int(num_islands),
            "population_size": int(population_size),
            "feature_dimensions": list(feature_dimensions),
            # a per-dimension dict: OpenEvolve raises a plain int to archive_size ** (1 / d)
            "feature_bins": dict(feature_bins)
            if isinstance(feature_bins, Mapping)
            else {f: int(feature_bins) for f in feature_dimensions},
            "migration_interval": int(migration_interval),
            "migration_rate": float(migration_rate),
            "random_seed": int(seed),
        },
        "evaluator": {
            "timeout": int(eval_timeout),
            "cascade_evaluation": False,
            "parallel_evaluations": int(parallel_evaluations),
        },
    }
    if system_message:
        cfg["prompt"]["system_message"] = system_message
    for dotted, value in (overrides or {}).items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return out


def prompt_text(prompt: Any) -> str:
    """A plain-text rendering of a task prompt (chat messages joined by their contents)."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(str(m.get("content", "")) for m in prompt if m.get("role") in ("system", "user"))


def vllm_serve_command(
    checkpoint: str | os.PathLike[str],
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    served_model_name: str = "policy",
    seed: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv for vLLM's OpenAI-compatible server on ``checkpoint`` (base URL ``http://host:port/v1``)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--seed",
        str(seed),
        *extra_args,
    ]


def wait_for_server(
    base_url: str, timeout: float = 600.0, interval: float = 1.0, process: subprocess.Popen[Any] | None = None
) -> list[str]:
    """Poll ``GET {base_url}/models`` until it answers; returns the served model ids."""
    deadline = time.monotonic() + timeout
    url = base_url.rstrip("/") + "/models"
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server process exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=min(10.0, interval * 5)) as resp:
                data = json.loads(resp.read().decode("utf-8"))
                return [str(m.get("id")) for m in data.get("data", [])]
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as exc:
            last = exc
            time.sleep(interval)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s: {last}")


class VLLMServer:
    """Context manager: start a server process (default :func:`vllm_serve_command`), wait until
    ``/v1/models`` answers, terminate it on exit. ``base_url`` is the OpenAI base URL."""

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | None = None,
        *,
        port: int = 8000,
        host: str = "127.0.0.1",
        served_model_name: str = "policy",
        seed: int = 0,
        extra_args: Sequence[str] = (),
        command: Sequence[str] | None = None,
        ready_timeout: float = 900.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if command is None and checkpoint is None:
            raise ValueError("give a checkpoint or an explicit command")
        self.command = (
            list(command)
            if command is not None
            else vllm_serve_command(
                checkpoint,
                port=port,
                host=host,
                served_model_name=served_model_name,
                seed=seed,  # type: ignore[arg-type]
                extra_args=extra_args,
            )
        )
        self.base_url = f"http://{host}:{port}/v1"
        self.model = served_model_name
        self.ready_timeout = ready_timeout
        self.log_path = log_path
        self.process: subprocess.Popen[Any] | None = None

    def __enter__(self) -> Self:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_server(self.base_url, self.ready_timeout, process=self.process)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def _import_openevolve() -> Any:
    try:
        import openevolve  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(OPENEVOLVE_MISSING) from exc
    return openevolve


_DEFAULT_INITIAL = (
    "# EVOLVE-BLOCK-START\n# Write a complete solution to the problem here.\n# EVOLVE-BLOCK-END\n"
)


def run_openevolve(
    row: Mapping[str, Any],
    task: Any,
    *,
    api_base: str,
    model: str,
    out_dir: str | os.PathLike[str],
    iterations: int = 600,
    seed: int = 0,
    initial_program: str | None = None,
    task_name: str | None = None,
    task_params: Mapping[str, Any] | None = None,
    system_message: str | None = None,
    language: str = "python",
    feature_bins: int | Mapping[str, int] = 2,
    config_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run OpenEvolve on one problem with our evaluator against an OpenAI-compatible server.

    Writes config, evaluator and initial program into ``out_dir`` and returns
    ``{"best_score", "solved", "best_code", "metrics", "output_dir", "config", "evaluator"}``.
    Raises ImportError with install instructions when OpenEvolve is missing.
    """
    oe = _import_openevolve()
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reward = task.reward
    best = getattr(task, "best_scalar", None)
    ev = write_evaluator(
        out,
        reward,
        row,
        task_name=task_name,
        task_params=task_params,
        solved_threshold=float(best(row)) if callable(best) else 1.0,
    )
    feats = feature_names(reward, row)
    if system_message is None:
        system_message = (
            "You are improving a program that solves the problem below. Reply with the complete "
            f"program in one ```{language} block.\n\n" + prompt_text(row["prompt"])
        )
    cfg = write_openevolve_config(
        out / "config.yaml",
        api_base=api_base,
        model=model,
        feature_dimensions=feats,
        iterations=iterations,
        seed=seed,
        system_message=system_message,
        language=language,
        feature_bins=feature_bins,
        overrides=config_overrides,
    )
    init = out / "initial_program.py"
    init.write_text(initial_program if initial_program is not None else _DEFAULT_INITIAL, encoding="utf-8")
    res = oe.run_evolution(
        initial_program=str(init),
        evaluator=str(ev),
        config=str(cfg),
        iterations=iterations,
        output_dir=str(out / "openevolve_output"),
        cleanup=False,
    )
    metrics = dict(getattr(res, "metrics", None) or {})
    best_score = float(metrics.get("combined_score", getattr(res, "best_score", 0.0)) or 0.0)
    return {
        "best_score": best_score,
        "solved": bool(metrics.get("solved", 0.0)),
        "best_code": getattr(res, "best_code", ""),
        "metrics": metrics,
        "output_dir": str(out / "openevolve_output"),
        "config": str(cfg),
        "evaluator": str(ev),
    }
