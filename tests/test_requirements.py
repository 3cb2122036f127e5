"""vpo.requirements: the GPU path's package table agrees with pyproject.toml, and its checks name each
missing or wrong package in one line with the install command."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement as Parsed
from packaging.specifiers import SpecifierSet

from vpo import requirements as reqs

REPO = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_table_agrees_with_pyproject_extras_and_core_dependencies() -> None:
    project = pyproject()
    extras = {name: {Parsed(r).name: str(Parsed(r).specifier) for r in items}
              for name, items in project["optional-dependencies"].items()}
    core = {Parsed(r).name: str(Parsed(r).specifier) for r in project["dependencies"]}
    for r in reqs.REQUIREMENTS:
        if r.extra is not None:
            assert extras[r.extra].get(r.package) == str(SpecifierSet(r.spec)), (r.package, r.extra)
        elif r.package in core:
            assert core[r.package] == str(SpecifierSet(r.spec)), r.package
        else:  # in no extra and not a core dependency: the table says how to install it by hand
            assert all(r.package not in pins for pins in extras.values()), r.package
            assert f'"{r.package}{r.spec}"' in r.install and "pip install" in r.install, r.package
    table = {r.package for r in reqs.REQUIREMENTS if r.extra == "gpu"}
    assert table == set(extras["gpu"]), "every package of the gpu extra is in the table, and only those"
    assert "vllm" not in extras, "vLLM cannot be installed beside prefect (fastapi): it has its own environment"
    vllm = next(r for r in reqs.REQUIREMENTS if r.package == "vllm")
    assert f'"vllm{vllm.spec}"' in vllm.install and reqs.VLLM_ENV in vllm.install


def test_vllm_torch_pin_is_inside_the_torch_range() -> None:
    torch = next(r for r in reqs.REQUIREMENTS if r.package == "torch")
    assert reqs.VLLM_TORCH in SpecifierSet(torch.spec)
    assert f"torch=={reqs.VLLM_TORCH}" in reqs.TORCH_GPU_INSTALL


def test_needed_selects_by_feature_and_rejects_unknown_keys() -> None:
    assert [r.package for r in reqs.needed(["deepspeed"])] == ["deepspeed"]
    assert [r.package for r in reqs.needed(["gpu", "vllm", "lora"])] == ["torch", "accelerate", "vllm", "peft"]
    assert reqs.needed([]) == []
    with pytest.raises(ValueError, match="unknown feature zero3; known: gpu, deepspeed"):
        reqs.needed(["zero3"])
    assert {r.feature for r in reqs.REQUIREMENTS} <= set(reqs.FEATURES)
    assert len({r.package for r in reqs.REQUIREMENTS}) == len(reqs.REQUIREMENTS)


def test_problems_name_missing_and_wrong_versions_one_line_each() -> None:
    installed = {"torch": "2.13.0+cu130", "accelerate": "1.15.0", "vllm": "0.31.0", "peft": "0.21.2"}
    lines = reqs.problems(reqs.needed(["gpu", "deepspeed", "vllm", "lora", "flash_attention_2"]), installed.get)
    assert lines == [
        ('deepspeed is not installed (needed for trainer.accelerate_config with distributed_type DEEPSPEED): '
         'pip install "deepspeed==0.19.8"'),
        ('vllm 0.31.0 is installed but trainer.use_vllm or evaluation.use_vllm needs vllm==0.30.0: '
         + reqs.VLLM_INSTALL),
        ('flash-attn is not installed (needed for model_init_kwargs.attn_implementation: flash_attention_2): '
         'pip install "flash-attn>=2.8" --no-build-isolation  # needs nvcc; or use sdpa'),
    ]
    assert all("\n" not in line for line in lines)
    assert reqs.problems(reqs.needed(["gpu", "lora"]), installed.get) == []  # a local version (+cu130) is fine
    assert reqs.problems(reqs.needed(["lora"]), {"peft": "not-a-version"}.get)[0].startswith(
        "peft not-a-version is installed but")


def test_problems_read_installed_metadata_by_default() -> None:
    import peft
    import torch

    assert reqs.installed_version("torch") == torch.__version__
    assert reqs.installed_version("peft") == peft.__version__
    assert reqs.installed_version("no-such-distribution-vpo") is None
    assert reqs.problems(reqs.needed(["lora"])) == []  # the test extra pins the same peft
    missing = reqs.problems([reqs.Requirement("no-such-distribution-vpo", "nope", ">=1", None, "gpu")])
    assert missing == [('no-such-distribution-vpo is not installed (needed for training on a GPU): '
                        'pip install "no-such-distribution-vpo>=1"')]


def test_torch_cuda_problem() -> None:
    assert reqs.torch_cuda_problem("12.8", uses_vllm=False) is None
    assert reqs.torch_cuda_problem("13.0", uses_vllm=True) is None
    assert "CUDA 12.8" in reqs.torch_cuda_problem("12.8", uses_vllm=True)
    assert "a CPU build" in reqs.torch_cuda_problem(None, uses_vllm=True)


def test_importing_the_table_imports_no_heavy_package() -> None:
    code = ("import sys; import vpo.requirements as r; r.needed(['gpu']); "
            "heavy = [m for m in ('torch', 'transformers', 'vpo.pipeline', 'packaging') if m in sys.modules]; "
            "print(heavy); sys.exit(bool(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
