"""Fault: a crash at every write of every stage leaves each output old or new, never torn.

For each stage (data, rewards, base, train, evaluate, register) a clean run from an "old" state
records every write event under the work folder: each rename that publishes something (``os.replace``,
``os.rename``, the atomic folder exchange, ``os.link``) and each data write (``to_parquet``, ``np.save``,
``save_pretrained`` of models and tokenizers, ``Path.write_text/bytes``, ``savefig``). The stage is then
rerun from the same old state once per event k, crashing at event k: before a rename takes effect,
or right after a data write with the written file cut to half its size (a torn write). The crash is
an exception deriving from BaseException, so no ``except Exception`` in the code can swallow it.

After every crash each output unit (a stage folder such as ``data/`` or ``base/``, a model folder, a
single file) must be byte-identical to its old or to its new version as a whole (files that embed
timings or timestamps are compared by whether they load instead), and every registry entry must
still read back, written after its model card.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.faults import (
    RUN_NAME,
    copy_prepared,
    load_cfg,
    prepared_run,
    torch_threads,
    tree_digest,
)

# files whose bytes legitimately differ between two identical runs (timings, timestamps, pickled args)
NONDETERMINISTIC = {
    "summary.json",
    "sft_metrics.json",
    "metrics.json",
    "history.json",
    "registry.json",
    "training_args.bin",
    "validation.json",
}
ONE_ARM = {"arms.grpo.enabled": False, "arms.grpo_x3.enabled": False, "arms.max_at_k.enabled": False}


class Crash(BaseException):
    """The injected crash."""


@dataclass
class Injector:
    """Counts write events under ``root`` and crashes at event ``crash_at`` (None: only record)."""

    root: Path
    crash_at: int | None = None
    skip: tuple[str, ...] = ()
    events: list[tuple[str, str]] = field(default_factory=list)

    def _watched(self, target: Any) -> Path | None:
        if not isinstance(target, (str, os.PathLike)):
            return None
        path = Path(os.fspath(target)).absolute()
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return None
        return None if any(part in self.skip for part in rel.parts) else path

    def _hit(self, kind: str, path: Path) -> bool:
        self.events.append((kind, path.relative_to(self.root).as_posix()))
        return len(self.events) == self.crash_at

    def before_rename(self, kind: str, target: Any) -> None:
        """A rename/link publishing ``target`` is about to happen: crash here if it is event k."""
        path = self._watched(target)
        if path is not None and self._hit(kind, path):
            raise Crash(f"{kind} -> {path}")

    def after_write(self, kind: str, target: Any) -> None:
        """``target`` was just written: at event k, cut it (its largest file) to half and crash."""
        path = self._watched(target)
        if path is None or not self._hit(kind, path):
            return
        victim = (
            max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            if path.is_dir()
            else path
        )
        if victim.is_file():
            with open(victim, "r+b") as fh:
                fh.truncate(victim.stat().st_size // 2)
        raise Crash(f"{kind} tore {victim}")


def _install(monkeypatch: pytest.MonkeyPatch, inj: Injector) -> None:
    """Route the write primitives through ``inj``."""
    import matplotlib.figure
    import pandas as pd
    import transformers

    import vpo.atomic

    def renaming(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(src: Any, dst: Any, *a: Any, **kw: Any) -> Any:
            inj.before_rename(kind, dst)
            return fn(src, dst, *a, **kw)

        return wrapper

    def writing(kind: str, fn: Callable[..., Any], target: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            out = fn(*a, **kw)
            inj.after_write(kind, target(*a, **kw))
            return out

        return wrapper

    monkeypatch.setattr(os, "replace", renaming("os.replace", os.replace))
    monkeypatch.setattr(os, "rename", renaming("os.rename", os.rename))
    monkeypatch.setattr(os, "link", renaming("os.link", os.link))
    monkeypatch.setattr(vpo.atomic, "_exchange", renaming("exchange", vpo.atomic._exchange))

    def first(obj: Any, path: Any, *a: Any, **kw: Any) -> Any:
        return path

    monkeypatch.setattr(pd.DataFrame, "to_parquet", writing("to_parquet", pd.DataFrame.to_parquet, first))
    monkeypatch.setattr(np, "save", writing("np.save", np.save, lambda file, *a, **kw: file))
    for cls in (transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase):
        monkeypatch.setattr(
            cls,
            "save_pretrained",
            writing(f"{cls.__name__}.save_pretrained", cls.save_pretrained, lambda obj, d, *a, **kw: d),
        )
    monkeypatch.setattr(Path, "write_text", writing("write_text", Path.write_text, lambda p, *a, **kw: p))
    monkeypatch.setattr(Path, "write_bytes", writing("write_bytes", Path.write_bytes, lambda p, *a, **kw: p))
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", writing("savefig", matplotlib.figure.Figure.savefig, first)
    )


def _loads(path: Path) -> bool:
    """Whether a file whose bytes vary between runs is intact (it parses / loads)."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".bin":
            import torch

            torch.load(path, weights_only=False)
        else:
            return False
    except Exception:  # noqa: BLE001 - any failure to load means torn
        return False
    return True


def _unit_state(folder: Path, unit: str) -> Any:
    """Comparable state of one output unit: None if absent, else {file: sha256 | 'loads' | 'TORN'}."""
    path = folder / unit
    if not path.exists():
        return None
    files = (
        tree_digest(path, skip_hidden=True)
        if path.is_dir()
        else {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    )
    out = {}
    for rel, digest in files.items():
        file = path / rel if rel else path
        if file.name in NONDETERMINISTIC or (file.parent.parent.name == "entries" and file.suffix == ".json"):
            # entries carry created_at
            out[rel] = "loads" if _loads(file) else "TORN"
        else:
            out[rel] = digest
    return out


@dataclass
class Case:
    """One stage under crash injection."""

    stage: str
    units: Callable[[Path], list[str]]
    setup: Callable[[Path], None] = lambda folder: None
    overrides: dict[str, Any] = field(default_factory=dict)
    skip: tuple[str, ...] = ()


def _fake_sample(variant: int) -> Callable[..., list[list[str]]]:
    """Deterministic stand-in for sampling (the write path is under test, not the model)."""
    answers = ["RRRRRDDDDD", "DDDDDRRRRR", "RDRDRDRDRD", "UU", "garbage"]

    def sample(model: Any, tokenizer: Any, prompts: list[str], n: int = 1, **kw: Any) -> list[list[str]]:
        m = 3 if prompts and prompts[0].endswith("?3>") else 1
        return [
            [
                "".join(f"<r_{a + 1}>{answers[(i + j + a) % 5]}</r_{a + 1}>" for a in range(m))
                if (i + j + variant) % 3
                else "no answer here"
                for j in range(n)
            ]
            for i in range(len(prompts))
        ]

    return sample


def _arms(folder: Path, rids: tuple[str, ...] = ("vpo-s0",)) -> None:
    run = folder / "runs" / RUN_NAME
    for rid in rids:
        shutil.copytree(run / "base", run / "arms" / rid / "model")
        (run / "arms" / rid / "metrics.json").write_text(json.dumps({"final": {}}))


def _perturb_arm(folder: Path) -> None:
    """Give vpo-s0 other weights (a retrained arm) so a new registration differs from the old one."""
    from safetensors.torch import load_file, save_file

    weights = folder / "runs" / RUN_NAME / "arms" / "vpo-s0" / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    first = min(tensors)
    tensors[first] = tensors[first] + 0.01
    save_file(tensors, str(weights), metadata={"format": "pt"})


def run_stage(name: str, cfg: Any) -> dict[str, Any]:
    """The stage's own function (no skipping, no record), as the runner calls it."""
    from vpo.pipeline.config.layout import ArmRun, RunLayout
    from vpo.pipeline.engine.context import StageContext
    from vpo.pipeline.steps import stage

    run = ArmRun(cfg.arm("vpo"), 0) if name == "train" else None
    return stage(name).run(StageContext(cfg, RunLayout.of(cfg), name, run, progress=False))


def _setup_rewards(folder: Path) -> None:
    run_stage("data", load_cfg(folder / "pipelines.yaml", **{"task.params.seed": 1}))


def _setup_evaluate(folder: Path) -> None:
    import vpo.generation

    _arms(folder)
    original = vpo.generation.sample
    vpo.generation.sample = _fake_sample(0)
    try:
        run_stage("evaluate", load_cfg(folder / "pipelines.yaml", **ONE_ARM))
    finally:
        vpo.generation.sample = original


def _setup_register(folder: Path) -> None:
    _arms(folder)
    run_stage("register", load_cfg(folder / "pipelines.yaml", **ONE_ARM))
    _perturb_arm(folder)


def _registry_units(folder: Path) -> list[str]:
    reg = folder / "registry" / "entries"
    found = [p.relative_to(folder).as_posix() for p in reg.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return [f"runs/{RUN_NAME}/registry.json", f"runs/{RUN_NAME}/arms/vpo-s0/model/README.md", *found]


CASES = {
    "data": Case("data", lambda f: [f"runs/{RUN_NAME}/data"], overrides={"task.params.seed": 1}),
    "rewards": Case(
        "rewards",
        lambda f: [f"runs/{RUN_NAME}/rewards"],
        setup=_setup_rewards,
        overrides={"task.params.seed": 1},
    ),
    "base": Case(
        "base",
        lambda f: [f"runs/{RUN_NAME}/base"],
        overrides={"seed": 1, "sft.steps": 2, "sft.batch_size": 4},
    ),
    "train": Case(
        "train",
        lambda f: [f"runs/{RUN_NAME}/arms/vpo-s0/{u}" for u in ("model", "metrics.json", "history.json")],
        overrides={**ONE_ARM, "trainer.max_steps": 1, "trainer.save_steps": 1},
        skip=("trainer", "live", "progress.json", "progress.tmp"),
    ),
    "evaluate": Case(
        "evaluate", lambda f: [f"runs/{RUN_NAME}/eval"], setup=_setup_evaluate, overrides=ONE_ARM
    ),
    "register": Case("register", _registry_units, setup=_setup_register, overrides=ONE_ARM),
}


@pytest.fixture
def fake_sampling(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The new evaluation samples differ from the old ones (variant 1 vs 0); the great_expectations
    checks (seconds each, all before the first write) are computed once per distinct input."""
    import vpo.generation
    import vpo.pipeline.validation

    monkeypatch.setattr(vpo.generation, "sample", _fake_sample(1))
    for name in ("validate_dataset", "validate_reward_vectors"):
        monkeypatch.setattr(vpo.pipeline.validation, name, _memoised(getattr(vpo.pipeline.validation, name)))
    yield


def _memoised(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(df, **kw)`` computed once per (frame content, kwargs)."""
    import pandas as pd

    seen: dict[str, Any] = {}

    def wrapper(df: Any, **kw: Any) -> Any:
        key = hashlib.sha256(
            pd.util.hash_pandas_object(df.astype(str), index=True).to_numpy().tobytes()
            + repr(sorted(kw.items())).encode()
        ).hexdigest()
        if key not in seen:
            seen[key] = fn(df, **kw)
        return seen[key]

    return wrapper


def _check_registry(folder: Path) -> None:
    """Every entry (old or new) reads back and was written after its model card."""
    from vpo.pipeline.registry import Registry

    reg = folder / "registry"
    if not reg.exists():
        return
    entries, _, bad = Registry(reg, folder).scan()
    assert bad == []
    for entry in entries:
        assert (reg / "entries" / entry.artifact / f"{entry.hash}.md").is_file(), entry.label


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_crash_at_every_write_leaves_old_or_new(
    name: str,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    fake_sampling: None,
) -> None:
    """Crash the stage at each of its write events in turn; every output unit stays old or new."""
    case = CASES[name]
    old = tmp_path / "old"
    copy_prepared(prepared_run(tmp_path_factory.getbasetemp()), old)
    with torch_threads(1):
        case.setup(old)

    def run(folder: Path, crash_at: int | None) -> Injector:
        inj = Injector(folder.absolute(), crash_at, case.skip)
        cfg = load_cfg(folder / "pipelines.yaml", **case.overrides)
        with monkeypatch.context() as mp, torch_threads(1):
            _install(mp, inj)
            if crash_at is None:
                run_stage(case.stage, cfg)
            else:
                with pytest.raises(Crash):
                    run_stage(case.stage, cfg)
        return inj

    clean = tmp_path / "clean"
    shutil.copytree(old, clean)
    events = run(clean, None).events
    units = sorted(set(case.units(old)) | set(case.units(clean)))
    before = {u: _unit_state(old, u) for u in units}
    after = {u: _unit_state(clean, u) for u in units}
    assert any(before[u] != after[u] for u in units), (
        f"{name}: the new outputs equal the old ones; nothing to tell"
    )
    renames = [e for e in events if e[0] in ("os.replace", "os.rename", "exchange", "os.link")]
    assert renames, f"{name}: no output was published by a rename: {events}"
    for kind, target in events:  # data is only ever written to temp names, never onto a published path
        if kind not in ("os.replace", "os.rename", "exchange", "os.link"):
            assert any(part.startswith(".") or part.endswith(".tmp") for part in Path(target).parts), (
                kind,
                target,
            )
    _check_registry(clean)

    for k in range(1, len(events) + 1):
        crashed = tmp_path / f"crash-{k}"
        shutil.copytree(old, crashed)
        run(crashed, k)
        for unit in units:
            state = _unit_state(crashed, unit)
            assert state in (before[unit], after[unit]), (
                f"{name}: crash at event {k} {events[k - 1]} left {unit} neither old nor new: "
                f"{_diff(state, before[unit], after[unit])}"
            )
        _check_registry(crashed)
        shutil.rmtree(crashed)
    print(f"{name}: {len(events)} crash points, {len(renames)} publishing renames, units {units}")


def _diff(state: Any, old: Any, new: Any) -> str:
    """Which files of a unit differ from both versions (for the failure message)."""
    if state is None or old is None or new is None:
        return (
            f"state={'absent' if state is None else 'present'}, old={'absent' if old is None else 'present'}, "
            f"new={'absent' if new is None else 'present'}"
        )
    bad = sorted(k for k in set(state) | set(old) | set(new) if state.get(k) not in (old.get(k), new.get(k)))
    return f"files {bad}"
