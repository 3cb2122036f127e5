"""The pre-flight: a pipeline's settings name the GPU-path packages it needs; each missing one or wrong
version is one line with its install command, with the settings this machine cannot honour, before any
stage runs (``vpo run``, ``vpo flow``) and in ``vpo plan``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.configs import write_pipeline
from vpo.pipeline import config as C
from vpo.pipeline.engine import preflight
from vpo.pipeline.engine.errors import StageError

REPO = Path(__file__).resolve().parents[1]

ALL_RIGHT = {"torch": "2.13.0", "accelerate": "1.15.0", "deepspeed": "0.19.8", "vllm": "0.30.0", "peft": "0.21.2",
             "flash-attn": "2.8.3"}


def _accelerate(tmp_path: Path, kind: str, **extra: Any) -> str:
    path = tmp_path / f"{kind.lower()}.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": kind, "num_processes": 2, **extra}))
    return str(path)


def test_the_code_preset_needs_deepspeed_and_vllm_named_by_their_settings() -> None:
    cfg = C.load_pipeline("code-qwen-coder", REPO / "pipelines.yaml")
    used = preflight.features(cfg)
    assert used["deepspeed"] == [("trainer.accelerate_config infra/accelerate/deepspeed_zero2.yaml (distributed_type "
                                 "DEEPSPEED)")]
    assert used["vllm"] == ["trainer.use_vllm", "evaluation.use_vllm"]
    assert "lora" not in used and "flash_attention_2" not in used
    missing = preflight.package_problems(cfg, version_of=lambda pkg: None if pkg in ("deepspeed", "vllm")
                                         else ALL_RIGHT[pkg])
    assert missing[0] == ("deepspeed is not installed (needed for trainer.accelerate_config "
                          "infra/accelerate/deepspeed_zero2.yaml (distributed_type DEEPSPEED) in pipeline "
                          "'code-qwen-coder'): pip install \"deepspeed==0.19.8\"")
    assert missing[1].startswith("vllm is not installed (needed for trainer.use_vllm, evaluation.use_vllm in "
                                 "pipeline 'code-qwen-coder'): python -m venv /opt/vllm")
    assert len(missing) == 2


def test_lora_flash_attention_and_versions_each_get_their_line(tmp_path: Path) -> None:
    cfg = write_pipeline(tmp_path, trainer={"lora": {"r": 4}, "model_init_kwargs": {"attn_implementation": "flash_attention_2"}},
                    sft={"enabled": True, "lora": {"r": 4}})
    assert preflight.features(cfg) == {"lora": ["trainer.lora", "sft.lora"],
                                       "flash_attention_2": ["trainer.model_init_kwargs.attn_implementation"]}
    lines = preflight.package_problems(cfg, version_of={**ALL_RIGHT, "peft": "0.19.0", "flash-attn": None}.get)
    assert lines == [
        ("peft 0.19.0 is installed but trainer.lora, sft.lora in pipeline 'p' needs peft==0.21.2: "
        "pip install \"peft==0.21.2\""),
        ("flash-attn is not installed (needed for trainer.model_init_kwargs.attn_implementation in pipeline 'p'): "
        "pip install \"flash-attn>=2.8\" --no-build-isolation  # needs nvcc; or use sdpa")]
    assert preflight.package_problems(cfg, version_of=ALL_RIGHT.get) == []


def test_a_cpu_pipeline_needs_nothing_of_the_gpu_path(tmp_path: Path) -> None:
    cfg = C.load_pipeline("route", REPO / "pipelines.yaml", quick=True)
    assert preflight.features(cfg) == {}
    assert preflight.problems(cfg, cuda=False) == []
    preflight.check_preflight(cfg, cuda=False)


def test_an_arm_naming_its_own_gpu_setting_is_named(tmp_path: Path) -> None:
    cfg = write_pipeline(tmp_path, arms=[{"name": "g", "estimator": "grpo", "bf16": True},
                                    {"name": "h", "estimator": "grpo"}])
    assert preflight.features(cfg) == {"gpu": ["arms.g.bf16"]}
    assert preflight.hardware_problems(cfg, cuda=False) == [
        ("pipeline 'p': arms.g.bf16 is true but no CUDA GPU is visible; CPU training runs in float32 (set "
        "arms.g.bf16: false)")]
    assert preflight.hardware_problems(cfg, cuda=True) == []


def test_evaluation_use_vllm_follows_the_trainer_unless_set(tmp_path: Path) -> None:
    assert write_pipeline(tmp_path, trainer={"use_vllm": True}).evaluation.use_vllm is True
    assert write_pipeline(tmp_path).evaluation.use_vllm is False
    own = write_pipeline(tmp_path, trainer={"use_vllm": True}, evaluation={"use_vllm": False})
    assert own.evaluation.use_vllm is False
    assert "evaluation" not in write_pipeline(tmp_path, trainer={"use_vllm": True}).explicit_settings(), (
        "the inherited value is not written into params.yaml as if the file had set it")


def test_zero2_with_lora_passes_zero3_and_fsdp_with_lora_are_refused(tmp_path: Path) -> None:
    shutil.copy(REPO / "infra/accelerate/ds_zero3.json", tmp_path / "ds_zero3.json")
    zero3 = _accelerate(tmp_path, "DEEPSPEED", deepspeed_config={"deepspeed_config_file": "ds_zero3.json"})
    cfg = write_pipeline(tmp_path, trainer={"lora": {"r": 4}, "accelerate_config": zero3,
                                       "per_device_train_batch_size": 8})
    assert any("trainer.lora with trainer.accelerate_config" in line and "(ZeRO-3) is not supported" in line
               for line in preflight.hardware_problems(cfg, cuda=True))
    fsdp = _accelerate(tmp_path, "FSDP")
    cfg = write_pipeline(tmp_path, trainer={"lora": {"r": 4}, "accelerate_config": fsdp, "per_device_train_batch_size": 8})
    assert any("(FSDP) is not supported" in line for line in preflight.hardware_problems(cfg, cuda=True))
    zero2 = _accelerate(tmp_path, "DEEPSPEED", deepspeed_config={"zero_stage": 2})
    cfg = write_pipeline(tmp_path, trainer={"lora": {"r": 4}, "accelerate_config": zero2,
                                       "per_device_train_batch_size": 8})
    assert preflight.hardware_problems(cfg, cuda=True) == []


def test_check_preflight_is_one_error_with_every_line_and_skips_data_only_runs(tmp_path: Path) -> None:
    cfg = write_pipeline(tmp_path, trainer={"bf16": True, "use_vllm": True})
    with pytest.raises(StageError) as info:
        preflight.check_preflight(cfg, cuda=False)
    text = str(info.value)
    assert text.startswith("pipeline 'p' cannot run on this machine (checked before any stage ran):\n  ")
    lines = text.splitlines()[1:]
    assert len(lines) == len(preflight.problems(cfg, cuda=False)) >= 3
    assert any("trainer.bf16 is true but no CUDA GPU" in line for line in lines)
    preflight.check_preflight(cfg, ["data", "rewards"], cuda=False)  # nothing there loads a policy


@pytest.mark.slow  # a `vpo run` process: about 10 s on a loaded machine
@pytest.mark.integration
@pytest.mark.skipif(__import__("importlib.util").util.find_spec("deepspeed") is not None,
                    reason="shows the line for a machine without DeepSpeed")
def test_vpo_run_of_the_code_preset_stops_before_the_data_stage(tmp_path: Path) -> None:
    """``vpo run --pipeline code-qwen-coder`` on this CPU machine: the pre-flight lines, exit 2, no stage."""
    shutil.copy(REPO / "pipelines.yaml", tmp_path / "pipelines.yaml")
    shutil.copytree(REPO / "infra" / "accelerate", tmp_path / "infra" / "accelerate")
    proc = subprocess.run([sys.executable, "-m", "vpo.pipeline.cli", "run", "--pipeline", "code-qwen-coder"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "  deepspeed is not installed (needed for trainer.accelerate_config" in proc.stderr
    assert 'pip install "deepspeed==0.19.8"' in proc.stderr
    assert "data" not in proc.stdout and not (tmp_path / "runs" / "code-qwen-coder" / "data").exists()


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("deepspeed") is not None,
                    reason="shows the line for a machine without DeepSpeed")
def test_vpo_flow_stops_before_prefect_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``vpo flow`` checks before it starts a Prefect server or any stage: the same lines, exit 2."""
    from vpo.pipeline.cli import main

    shutil.copy(REPO / "pipelines.yaml", tmp_path / "pipelines.yaml")
    shutil.copytree(REPO / "infra" / "accelerate", tmp_path / "infra" / "accelerate")
    monkeypatch.chdir(tmp_path)
    assert main(["flow", "--pipeline", "code-qwen-coder"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pipeline 'code-qwen-coder' cannot run on this machine (checked before any stage ran)")
    assert "  deepspeed is not installed (needed for trainer.accelerate_config" in err
    assert not (tmp_path / "runs" / "code-qwen-coder" / "data").exists()
