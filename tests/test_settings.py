"""Every setting the schema accepts does something: trainer and arm fields reach VPOConfig through the
one mapping (vpo.pipeline.settings) or are pipeline-only with a stated effect; the other sections'
fields are read by the pipeline code; hardware settings fail clearly where the machine lacks them."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from vpo.pipeline import config as C
from vpo.pipeline.layout import ArmRun
from vpo.pipeline.settings import DERIVED, DIRECT, FIXED, check_hardware, vpo_config_kwargs

REPO = Path(__file__).resolve().parents[1]


def _vpo_fields() -> set[str]:
    from vpo.trainer import VPOConfig

    return {f.name for f in dataclasses.fields(VPOConfig)}


@pytest.mark.parametrize(("section", "model"), [("trainer", C.TrainerConfig), ("arms", C.ArmConfig)])
def test_every_trainer_and_arm_field_is_mapped_or_pipeline_only(section: str, model: type) -> None:
    for name in model.model_fields:
        direct = name in DIRECT[section]
        derived = f"{section}.{name}" in DERIVED
        assert direct != derived, f"{section}.{name}: map it to VPOConfig (DIRECT) or say what it does (DERIVED)"
    stale = [k for k in DERIVED if k.split(".")[0] == section and k.split(".")[1] not in model.model_fields]
    assert stale == [], f"DERIVED names settings the schema does not have: {stale}"


def test_direct_names_are_vpoconfig_fields() -> None:
    fields = _vpo_fields()
    for section, names in DIRECT.items():
        missing = [n for n in names if n not in fields]
        assert missing == [], f"{section}: not VPOConfig fields: {missing}"
    assert set(FIXED) <= fields


def test_each_setting_reaches_the_vpoconfig(tmp_path: Path) -> None:
    """Non-default values of every direct field arrive in the built VPOConfig, derived ones as stated."""
    from vpo.trainer import VPOConfig

    values = {"max_steps": 7, "learning_rate": 3e-5, "beta": 0.02, "temperature": 0.9, "max_completion_length": 40,
              "num_weights": 17, "weight_alpha": 0.5, "weight_sampler": "sobol", "loss_type": "grpo",
              "gradient_accumulation_steps": 2, "logging_steps": 3, "save_steps": 5, "save_total_limit": 4,
              "truncated_scores_zero": False, "prompts_per_step": 3, "report_to": ["dvclive", "tensorboard"],
              "min_parse_rate": 0.25, "max_unparsed_steps": 7}
    body = {"task": {"name": "route"}, "model": {"builder": "tiny"}, "trainer": values,
            "arms": [{"name": "v", "estimator": "gdpo", "num_answers": 2, "num_generations": 4,
                      "rollout_multiplier": 3, "seeds": [5], "max_completion_length": 60}]}
    path = tmp_path / "pipelines.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"version": 1, "pipelines": {"p": body}}))
    cfg = C.load_pipeline("p", path)
    kwargs = vpo_config_kwargs(cfg, ArmRun(cfg.arm("v"), 5), tmp_path / "out", cuda=False)
    args = VPOConfig(**kwargs)
    for name in DIRECT["trainer"]:
        if name in ("max_completion_length", "use_vllm", "vllm_mode", "vllm_server_base_url", "bf16"):
            continue
        assert getattr(args, name) == values[name], name
    assert args.max_completion_length == 60  # the arm's own limit wins
    assert (args.estimator, args.num_answers, args.num_generations) == ("gdpo", 2, 12)
    assert args.per_device_train_batch_size == 3 * 12 and (args.seed, args.data_seed) == (5, 5)
    assert args.report_to == ["tensorboard"]  # dvclive is the run folder's own callback
    assert args.output_dir == str(tmp_path / "out") and args.use_cpu


def test_other_sections_are_read_by_the_pipeline() -> None:
    """A field of a pipeline-only section that no pipeline module reads would be validated and ignored."""
    code = "\n".join(p.read_text() for p in [*(REPO / "vpo" / "pipeline").rglob("*.py"), *(REPO / "flows").glob("*.py")]
                     if p.name != "config.py")
    for model in (C.DatasetConfig, C.SFTConfig, C.EvaluationConfig, C.StorageConfig, C.SearchConfig, C.ModelConfig):
        for name in model.model_fields:
            assert re.search(rf"\.{name}\b", code), f"{model.__name__}.{name} is read nowhere"
    from vpo.search.database import ProgramDatabase

    db_params = set(inspect.signature(ProgramDatabase.__init__).parameters)
    assert set(C.SearchDatabaseConfig.model_fields) <= db_params  # passed as ProgramDatabase(**database)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only errors")
@pytest.mark.parametrize(("trainer", "fragment"), [
    ({"bf16": True}, "trainer.bf16 is true but no CUDA GPU is visible"),
    ({"use_vllm": True}, "trainer.use_vllm is true but vLLM is not installed"),
])
def test_gpu_settings_fail_clearly_on_a_cpu_machine(tmp_path: Path, trainer: dict, fragment: str) -> None:
    import yaml

    from vpo.pipeline.errors import StageError

    body = {"task": {"name": "route"}, "model": {"builder": "tiny"}, "trainer": trainer,
            "arms": [{"name": "g", "estimator": "grpo"}]}
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "pipelines": {"p": body}}))
    with pytest.raises(StageError, match=re.escape(fragment)):
        check_hardware(C.load_pipeline("p", path))
