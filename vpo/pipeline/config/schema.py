"""The schema of one pipeline: its sections, ``trainer:`` and ``arms:``, and :class:`PipelineConfig`.

``trainer:`` (every arm) and each arm of ``arms:`` (that arm only) take any field of
:class:`vpo.trainer.VPOConfig` -- TRL's ``GRPOConfig`` (https://huggingface.co/docs/trl/grpo_trainer)
plus the estimator's own fields -- under its own name and type: :class:`TrainerConfig` and
:class:`ArmConfig` subclass :class:`~vpo.pipeline.config.fields.VPOConfigFields`, where each is
declared once with its default, and add the pipeline's own settings (:data:`PIPELINE_ONLY`). A
run's value is the arm's, else the trainer's, else the declared default: the layering is done once,
when the pipeline is validated (:meth:`PipelineConfig._resolve_arms`), so ``arm.learning_rate`` is
the run's learning rate wherever it is read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vpo.pipeline.config.fields import DEFAULTS, VPOConfigFields
from vpo.pipeline.config.names import variant_name
from vpo.pipeline.config.sections import (
    NAME_RE,
    DatasetConfig,
    EvaluationConfig,
    ExecutionConfig,
    LoraConfig,
    ModelConfig,
    SearchConfig,
    SFTConfig,
    StorageConfig,
    Strict,
    TaskConfig,
    base_dir,
    unique,
)
from vpo.pipeline.config.source import ConfigError, from_set

__all__ = ["PIPELINE_ONLY", "RUN_INDEPENDENT_ARM_KEYS", "ArmConfig", "PipelineConfig", "PipelinesFile",
           "RLLoraConfig", "TrainerConfig"]

RUN_INDEPENDENT_ARM_KEYS = ("name", "seeds", "enabled")
"""Arm keys that choose which runs exist, not what one run is: no run's record or DVC params hold them."""


class RLLoraConfig(LoraConfig):
    """LoRA for the RL step (``trainer.lora``): the warm-up's LoRA settings, plus whether the adapter is
    kept beside the merged model the run publishes."""

    save_adapter: bool = Field(default=False, description="also save the adapter alone, in the run's adapter/")



class _TrainerOwn(Strict):
    """The trainer settings that are the pipeline's own (a few replace TRL's field of the same name)."""

    max_prompt_length: PositiveInt | None = Field(
        default=None, description="longest prompt in tokens: the train stage names the first longer row (TRL 1.16 "
                                  "has no prompt limit)")
    report_to: list[Literal["dvclive", "tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=lambda: ["dvclive"], description="TRL's trackers (tensorboard, wandb, trackio, mlflow) plus "
                                                         "dvclive, the default: each run's curves in its live/ folder")
    accelerate_config: str | None = Field(
        default=None, description="an accelerate config file: the train stage runs itself under `accelerate launch "
                                  "--config_file` (its num_processes is the world size the batch checks use)")
    lora: RLLoraConfig | None = Field(
        default=None, description="LoRA adapters for RL ({r, alpha, dropout, target_modules, save_adapter}): TRL gets "
                                  "a peft LoraConfig; the published model is the merged one (adapter/ beside it with "
                                  "save_adapter)")
    push_to_hub: bool = Field(
        default=False, description="the register stage uploads each run's final model to the Hub (TRL's name; the "
                                   "trainer itself pushes nothing)")
    hub_model_id: str | None = Field(default=None, description="Hub repo of a run: <hub_model_id>-<arm>-s<seed>")
    hub_private_repo: bool = Field(default=True, description="whether the register stage creates those Hub repos "
                                                             "private")

    @field_validator("hub_model_id")
    @classmethod
    def _check_hub_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", value):
            raise ValueError(f"hub_model_id {value!r} is not a Hub repo id (namespace/name)")
        return value

    @field_validator("accelerate_config")
    @classmethod
    def _check_accelerate(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            resolved = (base_dir(info) / Path(value).expanduser()).resolve()
            if not resolved.is_file():
                raise ValueError(f"accelerate config {value!r} does not exist (resolved to {resolved})")
        return value


class TrainerConfig(VPOConfigFields, _TrainerOwn):
    """RL trainer settings shared by all arms: any field of :class:`vpo.trainer.VPOConfig` (TRL's GRPOConfig
    plus the estimator's) under its own name, plus the pipeline's own (:data:`PIPELINE_ONLY`)."""

    @model_validator(mode="after")
    def _server_url(self) -> TrainerConfig:
        use_vllm, mode, url = self.use_vllm, self.vllm_mode, self.vllm_server_base_url
        if use_vllm and mode == "server" and not url:
            raise ValueError("vllm_mode 'server' needs vllm_server_base_url")
        if url and not (use_vllm and mode == "server"):
            raise ValueError("vllm_server_base_url is used only with use_vllm: true and vllm_mode: server")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub needs hub_model_id (namespace/name)")
        return self


class _ArmOwn(Strict):
    """What makes an arm: its name, estimator, seeds, switch and rollout multiplier."""

    name: Annotated[str, Field(pattern=NAME_RE, description="the arm's id: run ids <name>-s<seed>, run folders, DVC "
                                                           "stage names")]
    estimator: str = Field(description="a registered advantage estimator (vpo.advantages.ESTIMATORS)")
    rollout_multiplier: PositiveInt = Field(
        default=1, description="multiplies the arm's num_generations and its completion batch "
                               "(per_device_train_batch_size, generation_batch_size): a compute-matched "
                               "single-answer arm with as many prompts per step and x times the rollouts")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1,
                             description="one run per seed (VPOConfig.seed and data_seed)")
    enabled: bool = Field(default=True, description="disabled arms are not trained, evaluated or registered")

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, value: list[int]) -> list[int]:
        return unique(value, "seeds")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        from vpo.advantages import ESTIMATORS  # the registry is the one list of estimator names

        if value.lower() not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {value!r}; registered: "
                             f"{', '.join(repr(n) for n in sorted(ESTIMATORS))}")
        return value.lower()


class ArmConfig(VPOConfigFields, _ArmOwn):
    """One estimator arm of the experiment; each (arm, seed) is one training run and checkpoint. Besides
    its name, estimator, seeds, switch and rollout multiplier, an arm takes any VPOConfig field; what it
    does not set is the trainer's value (resolved when the pipeline loads)."""

    def completion_length(self, trainer: Any = None) -> int:
        """This arm's completion token limit (its own, else the trainer's: resolved at load)."""
        return self.max_completion_length

    @property
    def rollouts_per_prompt(self) -> int:
        """Effective rollouts per prompt: G x rollout multiplier."""
        return self.num_generations * self.rollout_multiplier

    def vpo_values(self) -> dict[str, Any]:
        """Every VPOConfig value of this arm's runs, as the pipeline resolved it (its own, else the
        trainer's, else the declared default), the rollout multiplier not applied."""
        return self.model_dump(include=set(VPOConfigFields.model_fields))

    def own_settings(self, trainer: Any = None) -> dict[str, Any]:
        """What the config sets for this arm itself (without its name), as plain JSON data; a null the
        ``trainer`` would also give is left out."""
        data = _explicit(self, null_default=lambda n: trainer is None or getattr(trainer, n, None) is None)
        data.pop("name", None)
        return data


PIPELINE_ONLY: dict[str, str] = {
    **{f"trainer.{name}": str(f.description) for name, f in _TrainerOwn.model_fields.items()},
    **{f"arms.{name}": str(_ArmOwn.model_fields[name].description)
       for name in dict.fromkeys([*RUN_INDEPENDENT_ARM_KEYS, *_ArmOwn.model_fields]) if name != "estimator"},
}
"""The settings of ``trainer:`` and ``arms:`` that are not VPOConfig fields passed through (``key: effect``)."""


class PipelineConfig(Strict):
    """One named pipeline of ``pipelines.yaml``."""

    name: Annotated[str, Field(pattern=NAME_RE)]
    description: str = ""
    seed: int = 0
    task: TaskConfig
    model: ModelConfig
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    arms: list[ArmConfig] = Field(min_length=1)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    search: SearchConfig | None = None
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)

    _source_file: Path | None = PrivateAttr(default=None)
    _quick: bool = PrivateAttr(default=False)
    _loaded: Any = PrivateAttr(default=None)  # the parsed file, for line numbers in later errors
    _origin: str = PrivateAttr(default="base")  # base | quick | params (command-line values: _overrides)
    _cli: tuple[str, ...] = PrivateAttr(default=())  # the `vpo` arguments that load this same config
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)  # the body validated (what overrides merge onto)
    _overrides: tuple[str, ...] = PrivateAttr(default=())  # dotted keys given with --set

    @field_validator("arms", mode="before")
    @classmethod
    def _arms_mapping(cls, value: Any) -> Any:
        """``arms`` may also be a mapping from arm name to its settings (the form params.yaml uses)."""
        if isinstance(value, Mapping):
            return [{"name": k, **v} if isinstance(v, Mapping) else v for k, v in value.items()]
        return value

    @field_validator("arms")
    @classmethod
    def _unique_arms(cls, arms: list[ArmConfig]) -> list[ArmConfig]:
        names = [a.name for a in arms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"arm names must be unique, duplicated: {', '.join(dupes)}")
        if not any(a.enabled for a in arms):
            raise ValueError("at least one arm must be enabled")
        return arms

    @model_validator(mode="after")
    def _resolve_arms(self) -> PipelineConfig:
        """Each arm gets the trainer's value of every VPOConfig field it does not set itself; what it set
        stays its own (``model_fields_set``, what :meth:`ArmConfig.own_settings` dumps)."""
        inherited = list(VPOConfigFields.model_fields)
        resolved = []
        for arm in self.arms:
            values = {n: getattr(arm, n) for n in ArmConfig.model_fields}
            values.update({n: getattr(self.trainer, n) for n in inherited if n not in arm.model_fields_set})
            resolved.append(ArmConfig.model_construct(_fields_set=set(arm.model_fields_set), **values))
        self.__dict__["arms"] = resolved  # frozen: the arms are replaced once, while validating
        return self

    @property
    def enabled_arms(self) -> list[ArmConfig]:
        """The arms that will be trained, in file order."""
        return [a for a in self.arms if a.enabled]

    def arm(self, name: str) -> ArmConfig:
        """The arm called ``name`` (KeyError listing the known arms otherwise)."""
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(
            f"pipeline {self.name!r} has no arm {name!r}; arms: {', '.join(a.name for a in self.arms)}"
        )

    @property
    def source_file(self) -> Path | None:
        """The YAML file this config was loaded from (None when built in code)."""
        return self._source_file

    @property
    def base_dir(self) -> Path:
        """Folder that relative paths in the config are resolved against."""
        return self._source_file.parent if self._source_file else Path.cwd()

    @property
    def quick(self) -> bool:
        """Whether the pipeline's ``quick:`` overrides were applied."""
        return self._quick

    def resolve_path(self, value: str | os.PathLike[str]) -> Path:
        """Resolve a path from the config against :attr:`base_dir`."""
        return (self.base_dir / Path(value).expanduser()).resolve()

    def resolve_url(self, value: str) -> str:
        """Return ``s3://`` URLs unchanged and local paths resolved against :attr:`base_dir`."""
        return value if value.startswith("s3://") else str(self.resolve_path(value.removeprefix("file://")))

    @property
    def variant(self) -> str:
        """The pipeline with its preset: ``route`` or ``route-quick`` (the run folder's name)."""
        return variant_name(self.name, self.quick)

    @property
    def model_source(self) -> str:
        """What ``from_pretrained`` gets: a local ``model.path_or_id`` resolved against the config
        file's folder (so it works from any working directory), else the hub id as written."""
        from vpo.models import resolve_model

        if self.model.path_or_id is None:
            raise ValueError(f"pipeline {self.name!r} builds or imports its model; it has no path_or_id")
        return resolve_model(self.model.path_or_id, self.base_dir)

    def params(self) -> dict[str, Any]:
        """The pipeline's name and :meth:`settings` as plain JSON data (registry entries, run metadata);
        :class:`PipelineConfig` validates it back into the same settings."""
        return {"name": self.name, **self.settings()}

    def cli_args(self) -> list[str]:
        """The ``vpo`` options that load this very config (file, pipeline or variant, preset, every
        ``--set``): a subprocess such as an ``accelerate launch`` of a stage gets the same settings."""
        return list(self._cli)

    def settings(self) -> dict[str, Any]:
        """The settings stage fingerprints read, as plain JSON data: every value of the pipeline's own
        sections; of ``trainer`` what is set plus the pipeline's own settings and defaults, and of each
        enabled arm (keyed by name, ``arms.<name>``) what it sets itself -- not the ~200 TRL defaults
        behind them, nor the arms that do not run."""
        data = self.model_dump(mode="json", exclude={"name", "description", "trainer", "arms"})
        return self._ordered(data, _explicit(self.trainer, keep=[*_TrainerOwn.model_fields, *DEFAULTS]))

    def explicit_settings(self) -> dict[str, Any]:
        """Only what the file, its quick preset and ``--set`` give, nulls that are defaults left out, of
        the enabled arms: the small, flat entry of a variant in ``params.yaml``."""
        return self._ordered(_explicit(self, drop=("name", "description", "trainer", "arms")), _explicit(self.trainer))

    def _ordered(self, data: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
        data = {**data, "trainer": trainer,
                "arms": {a.name: a.own_settings(self.trainer) for a in self.arms if a.enabled}}
        return {k: data[k] for k in type(self).model_fields if k in data}

    def problem(self, keys: Sequence[str | int], message: str) -> ConfigError:
        """A :class:`ConfigError` about the setting at ``keys`` (e.g. ``("task", "params", "source")``)
        found after loading (when a stage builds the task), with its file, pipeline and line -- or
        "from --set" when the value came from the command line."""
        key_text = ".".join(str(k) for k in keys)
        label = self.name if self._origin == "base" else f"{self.name} ({self._origin} settings)"
        if self._overrides:
            label += " with --set"
        if self._loaded is None:
            return ConfigError(self._source_file or "<in memory>", label, [(key_text, message)])
        if self._origin == "params":
            item = self._loaded.problem([self.variant, *keys], key_text, message)
        else:
            extra = ["quick"] if self._origin == "quick" else []
            item = self._loaded.problem(["pipelines", self.name, *extra, *keys], f"pipelines.{self.name}.{key_text}",
                                        message)
        if from_set(key_text, self._overrides):
            prefix = "" if self._origin == "params" else f"pipelines.{self.name}."
            item = (f"{prefix}{key_text} (from --set)", message)
        return ConfigError(self._loaded.path, label, [item])


def _explicit(model: BaseModel, *, keep: Sequence[str] = (), drop: Sequence[str] = (),
              null_default: Any = None) -> dict[str, Any]:
    """The fields of ``model`` that were given (or are in ``keep``), nested models likewise, as JSON data
    in field order; a null that is also the field's default is left out (``null_default(name)`` may
    veto)."""
    fields = type(model).model_fields
    wanted = [n for n in fields if (n in model.model_fields_set or n in keep) and n not in drop]
    dumped = model.model_dump(mode="json", include=set(wanted))
    out: dict[str, Any] = {}
    for name in wanted:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = _explicit(value)
        elif value is None and fields[name].default is None and (null_default is None or null_default(name)):
            continue
        else:
            out[name] = dumped[name]
    return out


class PipelinesFile(Strict):
    """Top level of ``pipelines.yaml`` (pipelines are validated one by one, see :func:`load_all`)."""

    version: Literal[1] = 1
    default: str | None = None
    pipelines: dict[str, dict[str, Any]] = Field(min_length=1)

    @model_validator(mode="after")
    def _default_exists(self) -> PipelinesFile:
        if self.default is not None and self.default not in self.pipelines:
            raise ValueError(
                f"default pipeline {self.default!r} is not defined; defined: {', '.join(self.pipelines)}"
            )
        return self

