"""Every trainer setting is one declaration: any VPOConfig (GRPOConfig) field in ``trainer:`` or an arm
reaches the VPOConfig the train stage builds, under its own name; the pipeline's own defaults say why
and give way to a setting; the few pipeline-only settings are documented; the declared fields are
exactly the installed dataclass's (a TRL upgrade that changes one fails with the line to write); TRL's
batch arithmetic is stated and checked on the world size; hardware settings fail clearly where the
machine lacks them."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vpo.pipeline import config as C
from vpo.pipeline.config.fields import DEFAULTS, RESERVED
from vpo.pipeline.config.layout import ArmRun
from vpo.pipeline.config.schema import PIPELINE_ONLY
from vpo.pipeline.config.settings import arm_batch, vpo_config_kwargs
from vpo.pipeline.engine.execution import check_hardware

REPO = Path(__file__).resolve().parents[1]


def _pipeline(tmp_path: Path, trainer: dict[str, Any] | None = None, arms: list[dict[str, Any]] | None = None,
              extra: dict[str, Any] | None = None) -> C.PipelineConfig:
    body = {"task": {"name": "route"}, "model": {"builder": "tiny"}, "trainer": trainer or {},
            "arms": arms or [{"name": "v", "estimator": "vpo", "num_answers": 3}], **(extra or {})}
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "pipelines": {"p": body}}))
    return C.load_pipeline("p", path)


def _vpo_config(cfg: C.PipelineConfig, arm: str, tmp_path: Path, seed: int = 0) -> Any:
    from vpo.trainer import VPOConfig

    return VPOConfig(**vpo_config_kwargs(cfg, ArmRun(cfg.arm(arm), seed), tmp_path / "out", cuda=False))


def test_grpo_fields_the_old_schema_lacked_reach_the_vpoconfig(tmp_path: Path) -> None:
    """Three GRPOConfig fields no hand-kept table listed, set in pipelines.yaml, are in the VPOConfig
    the train stage builds; an arm's own value wins over the trainer's for that arm only."""
    cfg = _pipeline(tmp_path, trainer={"gradient_checkpointing": True, "lr_scheduler_type": "cosine", "top_p": 0.9,
                                       "epsilon_high": 0.28, "mask_truncated_completions": True},
                    arms=[{"name": "v", "estimator": "vpo", "num_answers": 3},
                          {"name": "g", "estimator": "grpo", "top_p": 0.5, "learning_rate": 1e-5}])
    args = _vpo_config(cfg, "v", tmp_path)
    assert (args.gradient_checkpointing, args.lr_scheduler_type, args.top_p) == (True, "cosine", 0.9)
    assert (args.epsilon_high, args.mask_truncated_completions) == (0.28, True)
    other = _vpo_config(cfg, "g", tmp_path)
    assert (other.top_p, other.learning_rate, other.lr_scheduler_type) == (0.5, 1e-5, "cosine")
    assert args.learning_rate == DEFAULTS["learning_rate"][0]


def test_pipeline_defaults_apply_and_give_way(tmp_path: Path) -> None:
    """The paper's choices are defaults (constant LR, no warm-up, no checkpointing), not forced values."""
    args = _vpo_config(_pipeline(tmp_path, arms=[{"name": "v", "estimator": "grpo"}]), "v", tmp_path)
    for name, (value, why) in DEFAULTS.items():
        assert getattr(args, name) == value, name
        assert why, name
    changed = _pipeline(tmp_path, trainer={"lr_scheduler_type": "linear", "warmup_steps": 3,
                                           "gradient_checkpointing": True, "save_steps": 7})
    args = _vpo_config(changed, "v", tmp_path)
    assert (str(args.lr_scheduler_type.value), args.warmup_steps, args.gradient_checkpointing, args.save_steps) == (
        "linear", 3, True, 7)


def test_what_the_pipeline_sets_itself(tmp_path: Path) -> None:
    """Reserved fields come from the run (output folder, seed, device), dvclive is our callback, and the
    rollout multiplier scales the arm's G and its completion batch (same prompts per step)."""
    cfg = _pipeline(tmp_path, trainer={"report_to": ["dvclive", "tensorboard"], "per_device_train_batch_size": 8,
                                       "num_generations": 4},
                    arms=[{"name": "x", "estimator": "grpo", "rollout_multiplier": 3, "seeds": [5]}])
    args = _vpo_config(cfg, "x", tmp_path, seed=5)
    assert (args.seed, args.data_seed, args.use_cpu, args.output_dir) == (5, 5, True, str(tmp_path / "out"))
    assert args.report_to == ["tensorboard"]
    assert (args.num_generations, args.per_device_train_batch_size, args.generation_batch_size) == (12, 24, 24)
    plan = arm_batch(cfg, cfg.arm("x"))
    assert (plan.prompts_per_step, plan.completions_per_step) == (2, 24)


def test_the_declared_fields_are_the_installed_dataclass() -> None:
    """The schema the loader reads (no TRL import) declares every field of the installed VPOConfig
    under its type, default and help: `python -m vpo.pipeline.config.drift` says what to change."""
    from vpo.pipeline.config.drift import differences
    from vpo.trainer import VPOConfig

    found = differences(VPOConfig)
    assert not found, "vpo/pipeline/config/fields.py differs from the installed VPOConfig:\n" + "\n".join(found)


def test_a_field_trl_adds_or_changes_fails_the_check_with_the_line_to_write() -> None:
    """A TRL upgrade simulated by a dataclass with one field more and one default changed: each is one
    difference, the new field's with the declaration to paste."""
    from vpo.pipeline.config.drift import differences
    from vpo.trainer import VPOConfig

    @dataclasses.dataclass
    class Upgraded(VPOConfig):
        rollout_budget: int | None = dataclasses.field(
            default=4, metadata={"help": "Rollouts kept per prompt. Extra text the line does not carry."})
        top_k: int = dataclasses.field(default=50, metadata=VPOConfig.__dataclass_fields__["top_k"].metadata)

    found = differences(Upgraded)
    assert len(found) == 2, found
    assert found[0] == "top_k: the default is now 50 (declared: 0); take it, or keep ours with ours(value, why)"
    assert found[1] == ('new field rollout_budget: declare it (or list it in RESERVED with the reason)\n'
                        '    rollout_budget: int | None = 4\n    """Rollouts kept per prompt."""')


def test_loading_a_pipeline_imports_no_trl() -> None:
    """The schema is code of its own: a fresh interpreter loads every pipeline of pipelines.yaml without
    importing TRL or transformers."""
    import subprocess
    import sys

    code = ("import sys; from vpo.pipeline.config import load_all; load_all('pipelines.yaml'); "
            "print(sorted(m for m in ('trl', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_tables_name_real_settings_and_the_readme_lists_them() -> None:
    from vpo.trainer import VPOConfig

    fields = {f.name for f in dataclasses.fields(VPOConfig)}
    assert set(DEFAULTS) <= fields and set(RESERVED) - {"peft_config"} <= fields
    assert set(DEFAULTS) == {"max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "gradient_checkpointing",
                             "bf16", "dataloader_pin_memory", "max_completion_length", "num_answers", "logging_steps",
                             "save_steps", "save_total_limit"}  # the settings every run's record names
    for key in PIPELINE_ONLY:
        section, name = key.split(".")
        model = C.TrainerConfig if section == "trainer" else C.ArmConfig
        assert name in model.model_fields, key
    assert not set(RESERVED) & set(C.TrainerConfig.model_fields)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for key in [*PIPELINE_ONLY, *(f"trainer.{k}" for k in DEFAULTS)]:
        assert f"`{key}`" in readme, f"README's settings tables do not list {key}"


def test_every_vpoconfig_field_is_a_setting_or_reserved() -> None:
    """Nothing of VPOConfig is closed off: each field is settable in trainer: (and, except the
    pipeline's own, per arm), or reserved with a reason."""
    from vpo.trainer import VPOConfig

    for f in dataclasses.fields(VPOConfig):
        assert f.name in C.TrainerConfig.model_fields or f.name in RESERVED or f.name == "estimator", f.name


def test_other_sections_are_read_by_the_pipeline() -> None:
    """A field of a pipeline-only section that no pipeline module reads would be validated and ignored."""
    schema = {REPO / "vpo" / "pipeline" / "config" / name for name in ("sections.py", "schema.py")}
    code = "\n".join(p.read_text() for p in [*(REPO / "vpo" / "pipeline").rglob("*.py"), *(REPO / "flows").glob("*.py")]
                     if p not in schema)
    from vpo.pipeline.config import sections as S
    from vpo.pipeline.config.schema import RLLoraConfig

    for model in (S.DatasetConfig, S.SFTConfig, S.EvaluationConfig, S.StorageConfig, S.SearchConfig, S.ModelConfig,
                  RLLoraConfig):
        for name in model.model_fields:
            assert re.search(rf"\.{name}\b", code), f"{model.__name__}.{name} is read nowhere"
    from vpo.search.database import ProgramDatabase

    db_params = set(inspect.signature(ProgramDatabase.__init__).parameters)
    assert set(S.SearchDatabaseConfig.model_fields) <= db_params  # passed as ProgramDatabase(**database)


def test_lora_becomes_a_peft_config(tmp_path: Path) -> None:
    from vpo.pipeline.config.settings import peft_config

    cfg = _pipeline(tmp_path, trainer={"lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj"]}})
    peft = peft_config(cfg)
    assert (peft.r, peft.lora_alpha, peft.lora_dropout, set(peft.target_modules)) == (4, 8, 0.1, {"q_proj"})
    assert peft_config(_pipeline(tmp_path)) is None


@pytest.mark.parametrize(("world", "ok"), [(1, False), (2, True)])
def test_batch_divisibility_is_checked_on_the_world_size(tmp_path: Path, world: int, ok: bool) -> None:
    """per_device_train_batch_size 2 cannot hold a group of 4 on one process; two processes can
    (accelerate's num_processes is the world size); the error names the settings and a fix."""
    accel = tmp_path / "accel.yaml"
    accel.write_text(yaml.safe_dump({"distributed_type": "MULTI_CPU", "num_processes": world}))
    trainer = {"per_device_train_batch_size": 2, "num_generations": 4, "accelerate_config": "accel.yaml"}
    if ok:
        cfg = _pipeline(tmp_path, trainer=trainer)
        plan = arm_batch(cfg, cfg.arm("v"))
        assert (plan.world, plan.completions_per_step, plan.prompts_per_step) == (2, 4, 1)
        assert plan.describe() == ("1 prompts x 4 rollouts = 4 completions per optimizer step (2 processes x 2 per "
                                   "device x 1 accumulation); 1 prompts = 4 completions per generation round, for 1 "
                                   "step(s)")
        return
    with pytest.raises(C.ConfigError) as err:
        _pipeline(tmp_path, trainer=trainer)
    (key, msg), = err.value.problems
    assert key.startswith("pipelines.p.trainer.per_device_train_batch_size (line ")
    assert "per_device_train_batch_size 2 x 1 process(es) x steps_per_generation 1" in msg
    assert "num_generations 4" in msg and "e.g. per_device_train_batch_size 4" in msg


def test_generation_rounds_are_stated(tmp_path: Path) -> None:
    """steps_per_generation / generation_batch_size: a round feeds several optimizer steps."""
    cfg = _pipeline(tmp_path, trainer={"per_device_train_batch_size": 4, "num_generations": 4,
                                       "gradient_accumulation_steps": 2, "generation_batch_size": 16})
    plan = arm_batch(cfg, cfg.arm("v"))
    rec = plan.record()
    assert rec["completions_per_optimizer_step"] == 8 and rec["prompts_per_optimizer_step"] == 2
    assert rec["completions_per_generation_round"] == 16 and rec["prompts_per_generation_round"] == 4
    assert rec["optimizer_steps_per_generation_round"] == 2
    from vpo.trainer import VPOConfig

    args = VPOConfig(**vpo_config_kwargs(cfg, ArmRun(cfg.arm("v"), 0), tmp_path / "o", cuda=False))
    assert (args.generation_batch_size, args.steps_per_generation) == (16, 4)  # TRL agrees
    with pytest.raises(C.ConfigError, match="set generation_batch_size or steps_per_generation, not both"):
        _pipeline(tmp_path, trainer={"generation_batch_size": 16, "steps_per_generation": 2})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only errors")
@pytest.mark.parametrize(("trainer", "arms", "fragment"), [
    ({"bf16": True}, None, "trainer.bf16 is true but no CUDA GPU is visible"),
    ({}, [{"name": "g", "estimator": "grpo", "fp16": True}], "arms.g.fp16 is true but no CUDA GPU is visible"),
    ({"use_vllm": True}, None, "trainer.use_vllm is true but vLLM is not installed"),
])
def test_gpu_settings_fail_clearly_on_a_cpu_machine(tmp_path: Path, trainer: dict, arms: Any, fragment: str) -> None:
    from vpo.pipeline.engine.errors import StageError

    cfg = _pipeline(tmp_path, trainer=trainer, arms=arms or [{"name": "g", "estimator": "grpo"}])
    with pytest.raises(StageError, match=re.escape(fragment)):
        check_hardware(cfg)


def test_a_world_size_other_than_planned_is_one_error(tmp_path: Path) -> None:
    """accelerate starts one process for a MULTI_CPU config without MPI: the run refuses instead of
    training a batch other than the one it stated."""
    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.context import StageContext
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.stages.train import _check_world

    (tmp_path / "accel.yaml").write_text(yaml.safe_dump({"distributed_type": "MULTI_CPU", "num_processes": 2}))
    cfg = _pipeline(tmp_path, trainer={"accelerate_config": "accel.yaml", "per_device_train_batch_size": 8,
                                       "num_generations": 4})
    ctx = StageContext(cfg, RunLayout.of(cfg), "train", ArmRun(cfg.arm("v"), 0))
    _check_world(ctx, 2)
    with pytest.raises(StageError, match=r"v-s0: 1 process\(es\) train this run, but its batch was planned for 2 "
                                         r"\(num_processes of trainer.accelerate_config accel.yaml\)"):
        _check_world(ctx, 1)


def test_a_value_trl_refuses_is_one_stage_error_before_any_model_loads(tmp_path: Path) -> None:
    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.context import StageContext
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.stages.train import train

    cfg = _pipeline(tmp_path, trainer={"auto_find_batch_size": True})
    ctx = StageContext(cfg, RunLayout.of(cfg), "train", ArmRun(cfg.arm("v"), 0))
    with pytest.raises(StageError, match=r"v-s0: TRL's GRPOConfig / VPOConfig rejected the settings of arm 'v' in "
                                         r"pipeline 'p': auto_find_batch_size is not supported by GRPO"):
        train(ctx)
