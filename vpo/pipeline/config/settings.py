"""Trainer settings: one declaration per setting, and the one function that builds a run's VPOConfig.

``trainer:`` (every arm) and each arm of ``arms:`` (that arm only) take **any field of**
:class:`vpo.trainer.VPOConfig` -- TRL's ``GRPOConfig`` (https://huggingface.co/docs/trl/grpo_trainer)
plus the estimator's own fields -- under its own name and type. A run's value is the arm's, else the
trainer's, else :data:`DEFAULTS` (the pipeline's choices, e.g. the paper's constant learning rate),
else VPOConfig's default. Names and types come from the dataclass itself: :data:`FIELDS_MODULE` is
generated from ``dataclasses.fields(VPOConfig)`` and its type hints (``python -m vpo.pipeline.config.settings``
rewrites it; a test fails when it is stale), so loading ``pipelines.yaml`` never imports TRL. When the
installed TRL or transformers differ from the versions it was generated with, the live dataclass is
read instead.

The settings that are the pipeline's own are :data:`PIPELINE_ONLY`; the VPOConfig fields the pipeline
sets itself (output folder, seed, device) are :data:`RESERVED` and refused in the config.
:func:`vpo_config_kwargs` is the one mapping from a loaded pipeline to a run's VPOConfig keyword
arguments; :func:`batch_plan` states TRL's batch arithmetic for a run (what one optimizer step and one
generation round hold) and :func:`check_hardware` refuses, in one line, settings this machine cannot
honour.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpo.pipeline.engine.errors import StageError

if TYPE_CHECKING:
    from vpo.pipeline.config import ArmConfig, PipelineConfig
    from vpo.pipeline.config.layout import ArmRun

__all__ = ["BOUNDS", "DEFAULTS", "FIELDS_MODULE", "PIPELINE_ONLY", "RESERVED", "TRL_DOCS", "BatchPlan", "batch_plan",
           "check_hardware", "describe_vpo_config", "vpo_config_kwargs", "vpo_fields", "world_size"]

TRL_DOCS = "https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig"
"""Where TRL documents every GRPOConfig field (named in errors and in pipelines.yaml)."""

FIELDS_MODULE = "vpo.pipeline.config.vpo_config_fields"
"""The generated table of VPOConfig's field names, types, defaults and declared bounds/choices."""

DEFAULTS: dict[str, tuple[Any, str]] = {
    "max_steps": (100, "the pipeline trains a fixed number of optimizer steps (TRL: -1, i.e. by epochs)"),
    "learning_rate": (5e-4, "sized for the embedded char model; every shipped pipeline sets its own"),
    "lr_scheduler_type": ("constant", "the paper trains at a constant learning rate (TRL: linear decay)"),
    "warmup_steps": (0, "the paper uses no warm-up"),
    "gradient_checkpointing": (False, "off: on CPU it only costs time (TRL: on); turn it on for big models"),
    "bf16": (False, "float32 unless asked (TRL: bf16 where supported); CPUs train in float32"),
    "dataloader_pin_memory": (False, "pinning helps only with CUDA and warns on CPU"),
    "max_completion_length": (64, "short answers (TRL: 512); m answers need about m times more"),
    "num_answers": (1, "single-answer arms unless an arm says m (VPOConfig: 3)"),
    "logging_steps": (1, "a log record (and a progress-bar update) every step (TRL: 10)"),
    "save_steps": (25, "resume checkpoints every 25 steps (TRL: 500)"),
    "save_total_limit": (2, "resume checkpoints kept while a run trains; all are deleted once it finished"),
}
"""The pipeline's own defaults for VPOConfig fields, with why: written into ``params.yaml`` beside what a
pipeline sets, and changed like any setting (``trainer.lr_scheduler_type: cosine``)."""

PIPELINE_ONLY: dict[str, str] = {
    "trainer.max_prompt_length": "longest prompt in tokens: the train stage names the first longer row (TRL 1.16 has "
                                 "no prompt limit)",
    "trainer.report_to": "TRL's trackers (tensorboard, wandb, trackio, mlflow) plus dvclive, the default: each run's "
                         "curves in its live/ folder",
    "trainer.accelerate_config": "an accelerate config file: the train stage runs itself under `accelerate launch "
                                 "--config_file` (its num_processes is the world size the batch checks use)",
    "trainer.lora": "LoRA adapters for RL ({r, alpha, dropout, target_modules, save_adapter}): TRL gets a peft "
                    "LoraConfig; the published model is the merged one (adapter/ beside it with save_adapter)",
    "trainer.push_to_hub": "the register stage uploads each run's final model to the Hub (TRL's name; the trainer "
                           "itself pushes nothing)",
    "trainer.hub_model_id": "Hub repo of a run: <hub_model_id>-<arm>-s<seed>",
    "trainer.hub_private_repo": "whether the register stage creates those Hub repos private",
    "arms.name": "the arm's id: run ids <name>-s<seed>, run folders, DVC stage names",
    "arms.seeds": "one run per seed (VPOConfig.seed and data_seed)",
    "arms.enabled": "disabled arms are not trained, evaluated or registered",
    "arms.rollout_multiplier": "multiplies the arm's num_generations and its completion batch "
                               "(per_device_train_batch_size, generation_batch_size): a compute-matched "
                               "single-answer arm with as many prompts per step and x times the rollouts",
}
"""The settings of ``trainer:`` and ``arms:`` that are not VPOConfig fields passed through (``key: effect``)."""

RESERVED: dict[str, str] = {
    "output_dir": "the pipeline writes checkpoints to runs/<variant>/arms/<run>/trainer",
    "seed": "set per run from arms.<name>.seeds",
    "data_seed": "set per run from arms.<name>.seeds",
    "use_cpu": "set from the machine (CUDA visible or not)",
    "disable_tqdm": "the console shows its own progress bar",
    "resume_from_checkpoint": "the train stage resumes from its newest intact checkpoint itself",
    "local_rank": "set by the launcher",
    "hub_token": "a secret: give it as HF_TOKEN in the environment, never in a file",
    "hub_strategy": "the trainer pushes nothing; push_to_hub uploads the final model at registration",
    "reward_weights": "VPOConfig takes the scalarisation as w_star",
    "peft_config": "set trainer.lora",
}
"""VPOConfig fields the pipeline sets itself (a config that sets one is an error saying why)."""

BOUNDS: dict[str, dict[str, float]] = {
    "max_steps": {"gt": 0},
    "per_device_train_batch_size": {"ge": 1},
    "gradient_accumulation_steps": {"ge": 1},
    "num_generations": {"ge": 2},
    "generation_batch_size": {"ge": 1},
    "steps_per_generation": {"ge": 1},
    "num_iterations": {"ge": 1},
    "learning_rate": {"gt": 0},
    "beta": {"ge": 0},
    "temperature": {"gt": 0},
    "max_completion_length": {"gt": 0},
    "logging_steps": {"gt": 0},
    "save_steps": {"gt": 0},
    "save_total_limit": {"ge": 1},
}
"""Ranges the pipeline needs of TRL's fields (checked when the config loads, before TRL is imported);
VPOConfig's own fields declare theirs in their dataclass metadata."""


# --------------------------------------------------------------------------- the field table


def _type_spec(hint: Any) -> dict[str, Any]:
    """A JSON description of a type hint: bool/int/float/str/null, literal (enum values and declared
    choices), list, dict, union, or object (a Python object no YAML value can be)."""
    origin = typing.get_origin(hint)
    if hint is type(None) or hint is None:
        return {"type": "null"}
    if hint in (bool, int, float, str):
        return {"type": hint.__name__}
    if hint is Any:
        return {"type": "any"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"type": "literal", "values": [m.value for m in hint]}
    if origin is typing.Literal:
        return {"type": "literal", "values": list(typing.get_args(hint))}
    if origin in (typing.Union, types.UnionType):
        args = list(typing.get_args(hint))
        if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args) and str in args:
            args.remove(str)  # `SchedulerType | str`: the string must be one of the enum's values
        return {"type": "union", "of": [_type_spec(a) for a in args]} if len(args) > 1 else _type_spec(args[0])
    if origin in (list, tuple) or hint in (list, tuple):
        inner = typing.get_args(hint)
        return {"type": "list", "of": _type_spec(inner[0]) if inner else {"type": "any"}}
    if origin is dict or hint is dict:
        inner = typing.get_args(hint)
        return {"type": "dict", "of": _type_spec(inner[1]) if len(inner) == 2 else {"type": "any"}}
    return {"type": "object", "name": getattr(hint, "__name__", str(hint))}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # an object default (none in TRL 1.16 but None itself)


def describe_vpo_config() -> dict[str, Any]:
    """Every init field of VPOConfig: type (see :func:`_type_spec`), default, and the bounds/choices its
    metadata declares; plus the TRL and transformers versions it describes. Imports TRL."""
    from vpo.trainer import VPOConfig

    hints = typing.get_type_hints(VPOConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(VPOConfig):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        spec: dict[str, Any] = {"type": _type_spec(hints[f.name]), "default": _plain(default)}
        choices = f.metadata.get("choices")
        if choices is not None:
            spec["choices"] = list(choices)
        for bound in ("gt", "ge", "lt", "le"):
            if bound in f.metadata:
                spec[bound] = f.metadata[bound]
        fields[f.name] = spec
    return {"versions": _versions(), "fields": fields}


def _versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("trl", "transformers")}


def _module_text(table: dict[str, Any]) -> str:
    import pprint

    lines = ['"""GENERATED from vpo.trainer.VPOConfig by `python -m vpo.pipeline.config.settings`: its init fields\' types,',
             "defaults and declared bounds/choices, read when pipelines.yaml loads (without importing TRL).",
             'Do not edit; a test fails when this differs from the dataclass."""', "",
             f"VERSIONS = {table['versions']!r}", "", "FIELDS = {"]
    for name, spec in table["fields"].items():
        lines.append(f"    {name!r}: {pprint.pformat(spec, width=1000, sort_dicts=False)},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def fields_module_path() -> Path:
    """The file of :data:`FIELDS_MODULE`."""
    return Path(__file__).with_name(FIELDS_MODULE.rsplit(".", 1)[1] + ".py")


@cache
def vpo_fields() -> dict[str, dict[str, Any]]:
    """VPOConfig's fields (name -> spec), from :data:`FIELDS_MODULE`, or from the live dataclass when the
    installed TRL or transformers are not the versions it was generated with."""
    try:
        module = importlib.import_module(FIELDS_MODULE)
    except ImportError:
        module = None
    try:
        current = _versions()
    except importlib.metadata.PackageNotFoundError:
        current = {}
    if module is not None and module.VERSIONS == current:
        return dict(module.FIELDS)
    return describe_vpo_config()["fields"]


# --------------------------------------------------------------------------- a run's VPOConfig


def world_size(cfg: PipelineConfig) -> int:
    """Processes one run trains on: the accelerate config's ``num_processes`` with
    ``trainer.accelerate_config``, else ``WORLD_SIZE`` (torchrun), else 1."""
    path = cfg.trainer.accelerate_config
    if path:
        return accelerate_processes(cfg.resolve_path(path))
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def accelerate_processes(path: Path) -> int:
    """``num_processes`` of an accelerate config file (1 when it names none or cannot be read)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return 1
    value = data.get("num_processes", 1) if isinstance(data, dict) else 1
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


@dataclass(frozen=True)
class BatchPlan:
    """TRL's batch arithmetic for one run: ``per_device`` completions per device per micro-step (the arm's
    per_device_train_batch_size x rollout multiplier), ``world`` processes, ``accumulation`` micro-steps per
    optimizer step, ``generations`` rollouts per prompt (G x multiplier), a generation round every
    ``steps_per_generation`` micro-steps reused ``num_iterations`` times."""

    per_device: int
    world: int
    accumulation: int
    generations: int
    steps_per_generation: int
    num_iterations: int

    @property
    def completions_per_step(self) -> int:
        """Completions one optimizer step trains on."""
        return self.per_device * self.world * self.accumulation

    @property
    def prompts_per_step(self) -> float:
        """Prompt groups one optimizer step trains on."""
        return self.completions_per_step / self.generations

    @property
    def completions_per_round(self) -> int:
        """TRL's generation_batch_size: completions generated per generation round."""
        return self.per_device * self.world * self.steps_per_generation

    @property
    def prompts_per_round(self) -> float:
        """Prompts sampled per generation round."""
        return self.completions_per_round / self.generations

    @property
    def steps_per_round(self) -> float:
        """Optimizer steps one generation round feeds."""
        return self.steps_per_generation * self.num_iterations / self.accumulation

    def record(self) -> dict[str, Any]:
        """The plan as plain data (the run's metrics.json and stage record)."""
        return {"world_size": self.world, "per_device_train_batch_size": self.per_device,
                "gradient_accumulation_steps": self.accumulation, "num_generations": self.generations,
                "steps_per_generation": self.steps_per_generation, "num_iterations": self.num_iterations,
                "completions_per_optimizer_step": self.completions_per_step,
                "prompts_per_optimizer_step": _number(self.prompts_per_step),
                "completions_per_generation_round": self.completions_per_round,
                "prompts_per_generation_round": _number(self.prompts_per_round),
                "optimizer_steps_per_generation_round": _number(self.steps_per_round)}

    def describe(self) -> str:
        """One console line: prompts and completions per optimizer step and per generation round."""
        processes = f"{self.world} process{'es' if self.world != 1 else ''}"
        return (f"{_number(self.prompts_per_step)} prompts x {self.generations} rollouts = {self.completions_per_step} "
                f"completions per optimizer step ({processes} x {self.per_device} per device x {self.accumulation} "
                f"accumulation); {_number(self.prompts_per_round)} prompts = {self.completions_per_round} completions "
                f"per generation round, for {_number(self.steps_per_round)} step(s)")


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 4)


def batch_plan(cfg: PipelineConfig, arm: ArmConfig, world: int | None = None) -> BatchPlan:
    """The batch of one run of ``arm`` on ``world`` processes (default :func:`world_size`); a
    :class:`ValueError` names the settings when TRL's divisibility rules do not hold."""
    world = world_size(cfg) if world is None else world
    mult = arm.rollout_multiplier
    per_device = arm.per_device_train_batch_size * mult
    accumulation = arm.gradient_accumulation_steps
    g = arm.rollouts_per_prompt
    where = f"arm {arm.name!r}" + (f" (x{mult} rollout_multiplier)" if mult != 1 else "")
    if arm.generation_batch_size is not None and arm.steps_per_generation is not None:
        raise ValueError(f"{where}: set generation_batch_size or steps_per_generation, not both (TRL derives one "
                         "from the other)")
    if arm.generation_batch_size is not None:
        gbs = arm.generation_batch_size * mult
        if gbs % (per_device * world):
            raise ValueError(f"{where}: generation_batch_size {gbs} must be a multiple of per_device_train_batch_size "
                             f"{per_device} x {world} process(es) = {per_device * world}")
        steps_per_generation = gbs // (per_device * world)
    else:
        steps_per_generation = arm.steps_per_generation or accumulation
    plan = BatchPlan(per_device, world, accumulation, g, steps_per_generation, arm.num_iterations)
    if plan.completions_per_round % g:
        raise ValueError(
            f"{where}: a generation round of {plan.completions_per_round} completions (per_device_train_batch_size "
            f"{per_device} x {world} process(es) x steps_per_generation {steps_per_generation}) does not hold whole "
            f"groups of num_generations {g}; make it a multiple of {g}, e.g. per_device_train_batch_size "
            f"{_lcm(per_device, g) if world == 1 else g} or more processes/steps_per_generation")
    return plan


def _lcm(a: int, b: int) -> int:
    import math

    return a * b // math.gcd(a, b)


def run_values(cfg: PipelineConfig, arm: ArmConfig) -> dict[str, Any]:
    """Every VPOConfig value of one arm that the config sets or the pipeline defaults: the arm's own
    values over the trainer's over :data:`DEFAULTS`."""
    fields = vpo_fields()
    out: dict[str, Any] = {name: value for name, (value, _) in DEFAULTS.items()}
    trainer_set = cfg.trainer.model_fields_set
    out.update({name: getattr(cfg.trainer, name) for name in trainer_set if name in fields
                and f"trainer.{name}" not in PIPELINE_ONLY})
    out.update({name: getattr(arm, name) for name in arm.model_fields_set if name in fields
                and f"arms.{name}" not in PIPELINE_ONLY})
    return out


def vpo_config_kwargs(cfg: PipelineConfig, run: ArmRun, output_dir: Path, *, cuda: bool,
                      progress: bool = True) -> dict[str, Any]:
    """Keyword arguments of the :class:`VPOConfig` that trains ``run``: the run's values (arm over trainer
    over :data:`DEFAULTS`), the rollout multiplier applied, and what the pipeline sets (:data:`RESERVED`)."""
    arm = run.arm
    kwargs = run_values(cfg, arm)
    mult = arm.rollout_multiplier
    kwargs["num_generations"] = arm.rollouts_per_prompt
    kwargs["per_device_train_batch_size"] = arm.per_device_train_batch_size * mult
    if arm.generation_batch_size is not None:
        kwargs["generation_batch_size"] = arm.generation_batch_size * mult
    trackers = [t for t in cfg.trainer.report_to if t != "dvclive"]
    kwargs.update(output_dir=str(output_dir), seed=run.seed, data_seed=run.seed, report_to=trackers or "none",
                  use_cpu=not cuda, disable_tqdm=not progress)
    return kwargs


def peft_config(cfg: PipelineConfig) -> Any:
    """The ``peft.LoraConfig`` of ``trainer.lora`` (None without one)."""
    lora = cfg.trainer.lora
    if lora is None:
        return None
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), task_type="CAUSAL_LM")


def check_hardware(cfg: PipelineConfig, *, cuda: bool | None = None) -> None:
    """Fail with one :class:`StageError` naming the setting when the machine cannot honour it."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    where = f"pipeline {cfg.name!r}"
    runs = [("trainer", cfg.trainer), *((f"arms.{a.name}", a) for a in cfg.enabled_arms)]
    for key, section in runs:
        if section.use_vllm and importlib.util.find_spec("vllm") is None:
            raise StageError(f"{where}: {key}.use_vllm is true but vLLM is not installed (pip install 'vpo[vllm]', "
                             f"GPU machines only); set {key}.use_vllm: false to generate with transformers")
        if section.use_vllm and not cuda:
            raise StageError(f"{where}: {key}.use_vllm is true but no CUDA GPU is visible; vLLM generation needs "
                             f"one (set {key}.use_vllm: false on CPU machines)")
        for flag in ("bf16", "fp16"):
            if getattr(section, flag) and not cuda:
                raise StageError(f"{where}: {key}.{flag} is true but no CUDA GPU is visible; CPU training runs in "
                                 f"float32 (set {key}.{flag}: false)")
    tr = cfg.trainer
    if cfg.evaluation.use_vllm and importlib.util.find_spec("vllm") is None:
        raise StageError(f"{where}: evaluation.use_vllm is true but vLLM is not installed (pip install "
                         "'vpo[vllm]', GPU machines only); set evaluation.use_vllm: false to sample with transformers")
    if cfg.evaluation.use_vllm and not cuda:
        raise StageError(f"{where}: evaluation.use_vllm is true but no CUDA GPU is visible (set it to false on CPU)")
    if tr.accelerate_config and importlib.util.find_spec("accelerate") is None:
        raise StageError(f"{where}: trainer.accelerate_config is set but accelerate is not installed")
    if tr.accelerate_config and not Path(cfg.resolve_path(tr.accelerate_config)).is_file():
        raise StageError(f"{where}: trainer.accelerate_config {tr.accelerate_config!r} does not exist")
    if tr.lora is not None and importlib.util.find_spec("peft") is None:
        raise StageError(f"{where}: trainer.lora is set but peft is not installed (pip install 'vpo[chat]')")
    for arm in cfg.enabled_arms:
        try:
            batch_plan(cfg, arm)
        except ValueError as exc:
            raise StageError(f"{where}: {exc}") from None


def _write_fields() -> int:
    path = fields_module_path()
    text = _module_text(describe_vpo_config())
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        print(f"{path} is up to date")
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(_write_fields())
