"""Error classes a user meets, each one line with exit code != 0: a full disk from any writer (naming the
disk that is full, not cut short), a full registry disk (the registry's disk, not the run folder's),
a YAML syntax error in pipelines.yaml from every command, and an exception no command expected."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from vpo.pipeline.engine.errors import StageError

REPO = Path(__file__).resolve().parents[1]


def _quick(tmp_path: Path) -> Any:
    from vpo.pipeline.config import load_pipeline

    data = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    data["pipelines"] = {"route": data["pipelines"]["route"]}
    data["pipelines"]["route"]["storage"] = {"registry": "registry", "runs_dir": "runs", "dvc_remote": None}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(data))
    return load_pipeline("route", tmp_path / "pipelines.yaml", quick=True)


class SafetensorError(Exception):
    """Stands for safetensors' own error type (raised from Rust; not an OSError)."""


def test_a_full_disk_from_any_writer_is_one_line_naming_the_disk(tmp_path: Path) -> None:
    from vpo.pipeline.config.layout import arm_runs
    from vpo.pipeline.runner import run_step
    from vpo.pipeline.steps import Step, stage

    cfg = _quick(tmp_path)
    why = ("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on "
           "device\" }) while writing runs/route-quick/arms/grpo-s0/trainer/checkpoint-2/model.safetensors")

    def full(ctx: object) -> dict:
        raise SafetensorError(why)

    with pytest.raises(StageError) as err:
        run_step(cfg, Step(replace(stage("train"), run=full), run=arm_runs(cfg)[0]), progress=False)
    line = str(err.value)
    assert line.startswith(f"train@grpo-s0: the disk holding {tmp_path / 'runs/route-quick/arms/grpo-s0'} is full "
                           "(mounted at "), line
    assert "MiB free)" in line and f"SafetensorError: {why}" in line and "\n" not in line  # nothing cut
    assert line.endswith("(it resumes from the last intact checkpoint)")


def test_a_full_registry_disk_names_the_registry_not_the_run_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The register stage writes into the registry: its disk is the full one (the run folder has room)."""
    from tests.test_registry import make_checkpoint
    from vpo.pipeline.registry import Registry
    from vpo.pipeline.registry import store as store_module
    from vpo.pipeline.runner import run_step
    from vpo.pipeline.steps import Step, stage

    cfg = _quick(tmp_path)
    registry = tmp_path / "elsewhere" / "registry"
    model = make_checkpoint(tmp_path / "model")

    def no_space(path: object, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name

    monkeypatch.setattr(store_module, "atomic_write_bytes", no_space)

    def register(ctx: object) -> dict:
        Registry(registry, tmp_path).register(model, name="route-quick", arm="vpo-s0")
        return {}

    with pytest.raises(StageError) as err:
        run_step(cfg, Step(replace(stage("register"), run=register)), progress=False)
    line = str(err.value)
    assert line.startswith(f"register: the disk holding {registry} is full (mounted at "), line
    assert "registry.json" not in line and "\n" not in line


@pytest.mark.parametrize("argv", [["run", "--quick"], ["stage", "data", "--quick"], ["flow", "--quick"],
                                  ["ui", "--quick"], ["serve", "--quick"], ["dvc"], ["dvc", "--check"], ["pipelines"],
                                  ["plan"], ["registry", "list"]])
def test_a_yaml_syntax_error_is_one_error_from_every_command(tmp_path: Path, argv: list[str]) -> None:
    """An unclosed `[` in pipelines.yaml: every command that reads it says where, exit 2, no traceback."""
    (tmp_path / "pipelines.yaml").write_text("version: 1\ndefault: route\npipelines: [\n  route: {}\n")
    proc = subprocess.run([sys.executable, "-m", "vpo.pipeline.cli", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "PREFECT_API_URL": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: invalid pipeline config in "), proc.stderr
    assert "not valid YAML: line " in proc.stderr


def test_an_exception_no_command_expected_is_one_line_and_the_traceback_goes_to_the_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vpo.pipeline import cli

    _quick(tmp_path)
    monkeypatch.chdir(tmp_path)

    def broken(args: object, cfg: object) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_job", broken)
    assert cli.main(["run", "--quick"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: KeyError: 'a bug' (unexpected: the traceback is in runs/route-quick/logs/"), err
    log = tmp_path / err.split("the traceback is in ", 1)[1].rstrip(")")
    assert "Traceback" in log.read_text() and "KeyError: 'a bug'" in log.read_text() and "\n" not in err
