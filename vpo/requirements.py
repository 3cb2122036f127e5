"""The packages the GPU path imports beyond the core install, as data: distribution, import name, version
spec, the ``pyproject.toml`` extra that installs it, the install command and what needs it.

The pre-flight of ``vpo run`` reads this table (:func:`needed`, :func:`problems`) to name each missing
package or wrong version in one line before any stage runs; ``tests/test_requirements.py`` keeps it equal
to ``pyproject.toml``'s extras and ``infra/Dockerfile.gpu``. Pure: nothing here imports the packages.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["FEATURES", "REQUIREMENTS", "TORCH_CUDA", "TORCH_GPU_INSTALL", "VLLM_ENV", "VLLM_INSTALL", "VLLM_TORCH",
           "Requirement", "installed_version", "needed", "problems", "torch_cuda_problem"]


@dataclass(frozen=True)
class Requirement:
    """One package: ``package`` (its PyPI name), ``module`` (what ``import`` names), ``spec`` (a PEP 440
    specifier), ``extra`` (the vpo extra that installs it; None: not in any), ``feature`` (the key of
    :data:`FEATURES` that needs it) and ``install`` (the command that installs it; default
    ``pip install "<package><spec>"``)."""

    package: str
    module: str
    spec: str
    extra: str | None
    feature: str
    install: str = ""

    def __post_init__(self) -> None:
        if not self.install:
            object.__setattr__(self, "install", f'pip install "{self.package}{self.spec}"')

    @property
    def requirement(self) -> str:
        """The requirement string as ``pyproject.toml`` writes it."""
        return f"{self.package}{self.spec}"


FEATURES: dict[str, str] = {
    "gpu": "training on a GPU",
    "deepspeed": "trainer.accelerate_config with distributed_type DEEPSPEED",
    "vllm": "trainer.use_vllm or evaluation.use_vllm",
    "lora": "trainer.lora",
    "flash_attention_2": "model_init_kwargs.attn_implementation: flash_attention_2",
}
"""What each feature key means in a pipeline's settings (the pre-flight maps its config onto these)."""

VLLM_TORCH = "2.13.0"
"""The torch version vLLM's wheel pins (``torch==2.13.0`` in vllm 0.30.0's metadata)."""
TORCH_CUDA = "13.0"
"""CUDA of the torch build vLLM's wheel is compiled against: PyPI's torch 2.13.0 Linux wheel (CUDA 13.0)."""
TORCH_GPU_INSTALL = f'pip install --force-reinstall "torch=={VLLM_TORCH}"  # from PyPI: the CUDA {TORCH_CUDA} build'
"""How to get that build (PyPI's default Linux wheel, not a cu12x index)."""
VLLM_ENV = "/opt/vllm"
"""Where the GPU image keeps vLLM's own environment (infra/Dockerfile.gpu)."""
VLLM_INSTALL = (f'python -m venv {VLLM_ENV} && {VLLM_ENV}/bin/pip install "vllm==0.30.0" "torch=={VLLM_TORCH}"'
                "  # its own environment (its fastapi pin conflicts with prefect's); then trainer.vllm_mode: "
                "server with infra/vllm/serve.sh")
"""vLLM cannot be installed beside vpo: it runs from its own environment as a server."""

REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("torch", "torch", ">=2.13,<2.14", None, "gpu"),
    Requirement("accelerate", "accelerate", "==1.15.0", None, "gpu"),
    Requirement("deepspeed", "deepspeed", "==0.19.8", "gpu", "deepspeed"),
    # In no extra: vLLM (fastapi < 0.137) and prefect 3.8.8 (fastapi >= 0.139) cannot share an environment.
    Requirement("vllm", "vllm", "==0.30.0", None, "vllm", install=VLLM_INSTALL),
    Requirement("peft", "peft", "==0.21.2", "gpu", "lora"),
    # PyPI has flash-attn as source only: it compiles against the installed torch with nvcc (CUDA toolkit).
    Requirement("flash-attn", "flash_attn", ">=2.8", None, "flash_attention_2",
                install='pip install "flash-attn>=2.8" --no-build-isolation  # needs nvcc; or use sdpa'),
)
"""The table. ``extra=None``: a core dependency (torch, accelerate) or a package no extra installs
(vLLM: its own environment; flash-attn: no wheel for torch 2.13 / CUDA 13 on PyPI)."""


def installed_version(package: str) -> str | None:
    """The installed version of a distribution, None when it is not installed (no import)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def needed(features: Iterable[str]) -> list[Requirement]:
    """The requirements of these feature keys, in table order; an unknown key is an error."""
    wanted = set(features)
    unknown = wanted - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown feature {', '.join(sorted(unknown))}; known: {', '.join(FEATURES)}")
    return [r for r in REQUIREMENTS if r.feature in wanted]


def problems(requirements: Iterable[Requirement],
             version_of: Callable[[str], str | None] = installed_version) -> list[str]:
    """One line per requirement that is missing or whose installed version is outside its spec, each
    with what needs it and the install command; empty when everything is in place."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    out = []
    for r in requirements:
        found = version_of(r.package)
        why = FEATURES[r.feature]
        if found is None:
            out.append(f"{r.package} is not installed (needed for {why}): {r.install}")
            continue
        try:
            ok = Version(found) in SpecifierSet(r.spec)
        except InvalidVersion:
            ok = False
        if not ok:
            out.append(f"{r.package} {found} is installed but {why} needs {r.package}{r.spec}: {r.install}")
    return out


def torch_cuda_problem(torch_cuda: str | None, uses_vllm: bool) -> str | None:
    """One line when vLLM will run on a torch built for another CUDA than its wheel's (``torch.version.cuda``
    of the installed torch; None: a CPU build), else None."""
    if not uses_vllm:
        return None
    if torch_cuda is None:
        return f"torch is a CPU build but vLLM needs torch {VLLM_TORCH} for CUDA {TORCH_CUDA}: {TORCH_GPU_INSTALL}"
    if torch_cuda.split(".")[0] != TORCH_CUDA.split(".")[0]:
        return (f"torch is built for CUDA {torch_cuda} but vLLM's wheel is compiled against torch {VLLM_TORCH} for "
                f"CUDA {TORCH_CUDA}: {TORCH_GPU_INSTALL}")
    return None
