"""Static validation of infra/ (no container engine or cluster here): Dockerfile, compose stack,
accelerate/DeepSpeed configs, the Kubernetes work-pool template, prefect.yaml and the vLLM recipe."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|API_KEY|PRIVATE_KEY)", re.IGNORECASE)
INTERPOLATION = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*(:?[-?][^}]*)?\}$")


def load_yaml(name: str) -> Any:
    return yaml.safe_load((INFRA / name).read_text())


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        op, _, args = full.partition(" ")
        out.append((op.upper(), args.strip()))
    assert not buf, "dangling line continuation"
    return out


def test_dockerfile_structure_and_torch_before_project() -> None:
    ins = dockerfile_instructions(INFRA / "Dockerfile")
    ops = [op for op, _ in ins]
    known = {
        "FROM",
        "ARG",
        "ENV",
        "RUN",
        "WORKDIR",
        "COPY",
        "USER",
        "ENTRYPOINT",
        "CMD",
        "LABEL",
        "EXPOSE",
        "HEALTHCHECK",
    }
    assert set(ops) <= known, set(ops) - known
    first = next(i for i, op in enumerate(ops) if op != "ARG")
    assert ops[first] == "FROM" and "python:${PYTHON_VERSION}-slim" in ins[first][1]
    assert "ARG PYTHON_VERSION=3.11" in (INFRA / "Dockerfile").read_text()
    runs = [(i, args) for i, (op, args) in enumerate(ins) if op == "RUN"]
    torch_i = next(i for i, a in runs if "torch==${TORCH_VERSION}" in a)
    assert "--index-url" in ins[torch_i][1]
    project_i = next(i for i, a in runs if re.search(r"pip install \"\.", a))
    copy_i = next(i for i, (op, _) in enumerate(ins) if op == "COPY")
    assert torch_i < copy_i < project_i, "torch must be installed before the project is copied and installed"
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args["VPO_EXTRAS"] == '""'
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "gpu" in extras  # the GPU image (infra/Dockerfile.gpu) installs this extra
    assert ops[-1] == "CMD" and [a for op, a in ins if op == "USER"] == ["vpo"]


def test_dockerfile_has_no_secrets_and_a_sane_context() -> None:
    ins = dockerfile_instructions(INFRA / "Dockerfile")
    for op, args in ins:
        if op in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split("=")[0]]
            assert not any(SECRET_NAME.search(n) for n in names), f"{op} {args}"
        assert "AWS_" not in args, f"credentials/endpoint must come from the runtime env: {op} {args}"
    for op, args in ins:
        if op == "COPY":
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            assert all((REPO / s).exists() for s in sources), sources
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().split()
    for must in (".git", ".venv", ".env", ".dvc/config.local", ".dvc/cache", "runs"):
        assert must in ignore


def test_dockerfile_hadolint_if_available() -> None:
    exe = shutil.which("hadolint")
    if not exe:
        pytest.skip("hadolint not installed (own structural checks above)")
    proc = subprocess.run(
        [exe, "--failure-threshold", "error", str(INFRA / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- GPU image


def test_gpu_dockerfile_installs_the_gpu_extra_on_the_torch_vllm_pins() -> None:
    """infra/Dockerfile.gpu and the `gpu` extra agree: torch is the build vLLM's wheel pins (PyPI's, CUDA
    13), installed before the project, and the project installs the `gpu` extra whose pins the table holds."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from vpo import requirements as reqs

    path = INFRA / "Dockerfile.gpu"
    ins = dockerfile_instructions(path)
    ops = [op for op, _ in ins]
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == reqs.VLLM_TORCH and args["TORCH_CUDA"] == reqs.TORCH_CUDA
    assert args["TORCH_INDEX_URL"] == "https://pypi.org/simple", "not a cu12x index: vLLM's wheel needs PyPI's torch"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    assert args["TORCH_VERSION"] in core["torch"]
    gpu = {Requirement(r).name: Requirement(r).specifier for r in project["optional-dependencies"]["gpu"]}
    assert {"deepspeed", "peft"} <= set(gpu) and "vllm" not in gpu
    vllm = next(r for r in reqs.REQUIREMENTS if r.package == "vllm")
    assert SpecifierSet(f"=={args['VLLM_VERSION']}") == SpecifierSet(vllm.spec) and args["VLLM_ENV"] == reqs.VLLM_ENV
    runs = [(i, a) for i, (op, a) in enumerate(ins) if op == "RUN"]
    torch_i = next(i for i, a in runs if '"torch==${TORCH_VERSION}"' in a)
    assert '--index-url "${TORCH_INDEX_URL}"' in ins[torch_i][1] and "${TORCH_CUDA}" in ins[torch_i][1]
    project_i = next(i for i, a in runs if 'pip install ".[gpu]"' in a)
    copy_i = ops.index("COPY")
    assert torch_i < copy_i < project_i
    assert "import torch, deepspeed, peft, vpo" in ins[project_i][1]  # the build fails if one is missing
    vllm_run = next(a for _, a in runs if '"vllm==${VLLM_VERSION}"' in a)  # its own venv, the same torch
    assert vllm_run.startswith('python -m venv "${VLLM_ENV}"') and '"torch==${TORCH_VERSION}"' in vllm_run
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in vllm_run and "import torch, vllm" in vllm_run
    assert "build-essential" in next(a for _, a in runs if "apt-get install" in a)  # Triton / DeepSpeed JIT
    assert ops[-1] == "CMD" and [a for op, a in ins if op == "USER"] == ["vpo"]
    assert "ARG PYTHON_VERSION=3.11" in path.read_text()
    ignore = INFRA / "Dockerfile.gpu.dockerignore"
    assert ignore.read_text() == (INFRA / "Dockerfile.dockerignore").read_text()
    cpu = (INFRA / "Dockerfile").read_text()
    assert "cu128" not in cpu and "Dockerfile.gpu" in cpu


# --------------------------------------------------------------------------- compose


def test_compose_services_builds_healthchecks_and_dependencies() -> None:
    doc = load_yaml("compose.yaml")
    assert set(doc) <= {"name", "services", "volumes", "networks", "configs", "secrets"} | {
        k for k in doc if k.startswith("x-")
    }
    services = doc["services"]
    assert {"prefect-server", "worker", "minio", "create-bucket", "postgres"} <= set(services)
    one_shot = {"create-bucket", "deploy"}
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            ctx = (INFRA / svc["build"]["context"]).resolve()
            assert ctx == REPO and (ctx / svc["build"]["dockerfile"]).is_file(), name
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert spec["condition"] in {
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            }
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep} to be healthy but it has no healthcheck"
                )
            if spec["condition"] == "service_completed_successfully":
                assert dep in one_shot
        if name in one_shot:
            assert svc["restart"] == "no", name
        else:
            hc = svc["healthcheck"]
            assert hc["test"][0] in ("CMD", "CMD-SHELL") and len(hc["test"]) >= 2, name
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in (doc.get("volumes") or {}), f"undeclared named volume {source}"
            else:
                assert (INFRA / source).resolve() == REPO
        for port in svc.get("ports", []):
            assert isinstance(port, str) and re.fullmatch(r"\d+:\d+", port)


def test_compose_has_no_inline_secrets_and_one_s3_config() -> None:
    doc = load_yaml("compose.yaml")
    for name, svc in doc["services"].items():
        env = svc.get("environment") or {}
        assert isinstance(env, dict), f"{name}: use the mapping form"
        for key, value in env.items():
            if SECRET_NAME.search(key) or key in ("MINIO_ROOT_USER", "AWS_ACCESS_KEY_ID"):
                assert isinstance(value, str) and INTERPOLATION.match(value), (
                    f"{name}.{key} must come from the env"
                )
            if key == "PREFECT_API_DATABASE_CONNECTION_URL":
                assert "${PREFECT_DB_PASSWORD" in value
    services = doc["services"]
    minio_env = services["minio"]["environment"]
    worker_env = services["worker"]["environment"]
    assert minio_env["MINIO_ROOT_USER"].startswith("${AWS_ACCESS_KEY_ID")
    assert minio_env["MINIO_ROOT_PASSWORD"].startswith("${AWS_SECRET_ACCESS_KEY")
    assert worker_env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert worker_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert worker_env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    cmd = services["worker"]["command"]
    pool = cmd[cmd.index("--pool") + 1]
    deployments = prefect_yaml()["deployments"]
    assert pool in {d["work_pool"]["name"] for d in deployments}
    assert "prefect --no-prompt deploy --name" in " ".join(services["deploy"]["command"])  # finds ./prefect.yaml
    assert services["deploy"]["working_dir"] == "/workspace"


def test_compose_config_with_docker_if_available() -> None:
    docker = shutil.which("docker")
    if (
        not docker
        or subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode != 0
    ):
        pytest.skip("docker compose plugin not available")
    env = {
        "AWS_ACCESS_KEY_ID": "x" * 8,
        "AWS_SECRET_ACCESS_KEY": "y" * 8,
        "PREFECT_DB_PASSWORD": "z" * 8,
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [docker, "compose", "-f", str(INFRA / "compose.yaml"), "config", "-q"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- accelerate / DeepSpeed


ACCELERATE = ["deepspeed_zero2.yaml", "fsdp.yaml"]


@pytest.mark.parametrize("name", ACCELERATE)
def test_accelerate_configs_load_and_use_known_launch_args(name: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    cfg = load_config_from_file(str(INFRA / "accelerate" / name))  # rejects unknown top-level keys
    assert isinstance(cfg, ClusterConfig) and cfg.num_machines == 1 and cfg.num_processes >= 2
    dests = {a.dest for a in launch_command_parser()._actions}
    nested = {"deepspeed_config": "", "fsdp_config": "fsdp_"}
    for section, prefix in nested.items():
        for key in getattr(cfg, section) or {}:
            arg = key if key.startswith(prefix) else prefix + key
            assert arg in dests, f"{name}: {section}.{key} is not an accelerate launch option"
    expected = {"deepspeed_zero2.yaml": "DEEPSPEED", "fsdp.yaml": "FSDP"}[name]
    assert str(cfg.distributed_type).endswith(expected)


DEEPSPEED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "zero_optimization",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "activation_checkpointing",
    "zero_allow_untested_optimizer",
    "communication_data_type",
}
ZERO_KEYS = {
    "stage",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "allgather_bucket_size",
    "reduce_bucket_size",
    "offload_optimizer",
    "offload_param",
    "round_robin_gradients",
}


def test_deepspeed_json_is_valid_and_consistent_with_accelerate() -> None:
    cfg = yaml.safe_load((INFRA / "accelerate" / "deepspeed_zero2.yaml").read_text())
    ds_path = REPO / cfg["deepspeed_config"]["deepspeed_config_file"]
    ds = json.loads(ds_path.read_text())
    assert set(ds) <= DEEPSPEED_KEYS, set(ds) - DEEPSPEED_KEYS
    assert set(ds["zero_optimization"]) <= ZERO_KEYS
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] in ("none", "cpu", "nvme")
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert ds[key] == "auto", f"{key} must be 'auto' so the trainer arguments fill it"
    # accelerate refuses these in deepspeed_config when a deepspeed_config_file is given
    refused = {
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_param_nvme_path",
        "offload_optimizer_nvme_path",
        "zero3_save_16bit_model",
        "mixed_precision",
    }
    assert not refused & set(cfg["deepspeed_config"])


# --------------------------------------------------------------------------- Kubernetes work-pool template


def k8s_template() -> dict[str, Any]:
    return json.loads((INFRA / "k8s" / "job-template.json").read_text())


def test_k8s_template_is_accepted_by_prefect_and_schema_valid() -> None:
    import jsonschema
    from prefect.server.schemas.actions import WorkPoolCreate

    template = k8s_template()
    assert set(template) == {"job_configuration", "variables"}
    WorkPoolCreate(
        name="vpo-kubernetes", type="kubernetes", base_job_template=template
    )  # Prefect's own check
    variables = template["variables"]
    jsonschema.Draft7Validator.check_schema(variables)
    defaults = {k: v["default"] for k, v in variables["properties"].items() if "default" in v}
    jsonschema.validate(defaults, variables)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**defaults, "gpu_count": -1}, variables)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**defaults, "memory_request": "lots"}, variables)


def test_k8s_template_renders_a_gpu_job_with_secret_credentials() -> None:
    from prefect.utilities.templating import apply_values, find_placeholders

    template = k8s_template()
    props = template["variables"]["properties"]
    used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    assert used <= set(props)
    assert not set(props) - used, f"variables never used: {set(props) - used}"
    values = {k: v.get("default") for k, v in props.items()} | {
        "name": "retrain-abc",
        "command": "python -m prefect.engine",
        "env": {"PREFECT__FLOW_RUN_ID": "1"},
        "labels": {"app": "vpo"},
        "gpu_count": 2,
    }
    job = apply_values(template["job_configuration"], values)
    manifest = job["job_manifest"]
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "prefect-job" and container["image"] == props["image"]["default"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["envFrom"] == [{"secretRef": {"name": "vpo-s3", "optional": False}}]
    assert pod["restartPolicy"] == "Never" and manifest["spec"]["backoffLimit"] == 0
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    assert "{{" not in json.dumps(manifest)
    text = json.dumps(template)
    assert not re.search(r"AWS_SECRET_ACCESS_KEY\"\s*:\s*\"[^{]", text)


# --------------------------------------------------------------------------- prefect.yaml


def prefect_yaml() -> dict[str, Any]:
    return yaml.safe_load((INFRA.parent / "prefect.yaml").read_text())


def test_prefect_yaml_is_where_prefect_deploy_looks_for_it() -> None:
    """`prefect deploy` reads ./prefect.yaml unless told otherwise: the file sits at the repository root."""
    import inspect

    from prefect.cli.deploy import _commands

    option = inspect.signature(_commands.deploy).parameters["prefect_file"]
    assert Path(option.default) == Path("prefect.yaml")
    assert (INFRA.parent / "prefect.yaml").is_file() and not (INFRA / "prefect.yaml").exists()


def test_prefect_yaml_validates_with_prefects_model_and_cron() -> None:
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.client.schemas.schedules import CronSchedule

    doc = prefect_yaml()
    model = PrefectYamlModel.model_validate(doc)
    assert model.prefect_version == "3.8.8"
    assert {d.work_pool.name for d in model.deployments} == {"vpo-process", "vpo-kubernetes"}
    for dep in doc["deployments"]:
        if dep["entrypoint"] != "flows/retrain.py:retrain":
            continue  # the one-arm flow runs when a retrain starts it, many at once (one per worker)
        assert dep["schedules"], dep["name"]
        for sched in dep["schedules"]:
            CronSchedule(cron=sched["cron"], timezone=sched["timezone"])
        assert dep["concurrency_limit"]["limit"] == 1  # two retrains never share a checkout
    assert "{{" in json.dumps(doc["pull"]) and "$VPO_REPO_DIR" in json.dumps(doc["pull"])


def test_prefect_yaml_k8s_job_variables_exist_in_the_template() -> None:
    props = k8s_template()["variables"]["properties"]
    k8s = next(d for d in prefect_yaml()["deployments"] if d["work_pool"]["name"] == "vpo-kubernetes")
    assert set(k8s["work_pool"]["job_variables"]) <= set(props)
    assert not any(SECRET_NAME.search(k) for k in k8s["work_pool"]["job_variables"].get("env", {}))


def test_prefect_yaml_entrypoints_point_to_real_flows() -> None:
    deployments = prefect_yaml()["deployments"]
    entrypoints = {d["entrypoint"] for d in deployments}
    assert entrypoints == {"flows/retrain.py:retrain", "flows/arm.py:train_arm"}
    for entrypoint in entrypoints:
        path, func = entrypoint.split(":")
        tree = ast.parse((REPO / path).read_text())
        fn = next(
            (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func),
            None,
        )
        assert fn is not None, f"{path} defines no top-level function {func}"
        decorators = [ast.unparse(d) for d in fn.decorator_list]
        assert any(re.match(r"(prefect\.)?flow\b", d) for d in decorators), decorators
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for dep in deployments:
            if dep["entrypoint"] == entrypoint:
                assert set(dep.get("parameters", {})) <= params, f"{dep['name']}: unknown flow parameters"


def test_infra_files_hold_no_credentials() -> None:
    pattern = re.compile(
        r"(aws_secret_access_key|secret_key|password)\s*[:=]\s*['\"]?(?!\$\{)[A-Za-z0-9/+]{8,}", re.IGNORECASE
    )
    for path in INFRA.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not pattern.search(text), path
            assert not re.search(r"AKIA[0-9A-Z]{16}", text), path


# --------------------------------------------------------------------------- vLLM recipe


SERVE = INFRA / "vllm" / "serve.sh"


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SERVE), *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_serve_script_syntax_and_modes() -> None:
    assert SERVE.stat().st_mode & 0o111, "serve.sh must be executable"
    assert subprocess.run(["bash", "-n", str(SERVE)], check=False).returncode == 0
    assert "set -euo pipefail" in SERVE.read_text()
    out = serve(
        "--dry-run",
        "--port",
        "8100",
        "--name",
        "policy",
        "--max-model-len",
        "4096",
        "Qwen/Qwen2.5-Coder-7B-Instruct",
    )
    argv = out.stdout.split("\n")[:-1]
    assert out.returncode == 0 and argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Coder-7B-Instruct"]
    assert (
        argv[argv.index("--port") + 1] == "8100" and argv[argv.index("--served-model-name") + 1] == "policy"
    )
    assert "--api-key" not in argv  # read by vLLM from VLLM_API_KEY, never on the command line
    bad = serve("--port", "http", "m")
    assert bad.returncode == 2 and "--port must be a number" in bad.stderr
    assert serve("--bogus").returncode == 2
    assert serve("--registry", "s3://b/r").returncode == 2


def test_serve_script_trl_mode_args_parse_with_trl() -> None:
    out = serve("--dry-run", "--trl", "--tp", "2", "--max-model-len", "2048", "/ckpt/policy")
    argv = out.stdout.split("\n")[:-1]
    assert out.returncode == 0 and argv[:2] == ["trl", "vllm-serve"]
    from trl.scripts.vllm_serve import make_parser

    (args,) = make_parser().parse_args_into_dataclasses(argv[2:])
    assert (args.model, args.tensor_parallel_size, args.max_model_len, args.port) == (
        "/ckpt/policy",
        2,
        2048,
        8000,
    )


def test_serve_script_fetches_registered_checkpoint_first() -> None:
    out = serve("--dry-run", "--registry", "s3://vpo-artifacts/registry", "--entry", "abc123def")
    fetch_part, serve_part = out.stdout.split("--\n")
    fetch_argv = fetch_part.split()
    assert fetch_argv[1:5] == ["-m", "vpo.pipeline.cli", "registry", "fetch"]
    dest = fetch_argv[-1]
    assert dest.endswith("/abc123def") and serve_part.split()[2] == dest
    from vpo.pipeline.registry.cli import main

    assert main(fetch_argv[4:] + ["--help"]) == 0  # `vpo registry ARGS` is the registry module's CLI
