"""pipelines.yaml schema: the shipped file loads, quick/override merging, and one clear ConfigError
naming file, pipeline, dotted key (and line) for every kind of mistake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vpo.pipeline.config import (
    ConfigError,
    PipelineConfig,
    deep_merge,
    load_all,
    load_pipeline,
    pipeline_names,
)

REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "pipelines.yaml"


def minimal(**sections: Any) -> dict[str, Any]:
    """A small valid pipeline body; keyword sections replace the defaults."""
    body: dict[str, Any] = {
        "task": {"name": "route"},
        "model": {"builder": "tiny"},
        "arms": [{"name": "grpo", "estimator": "grpo"}, {"name": "vpo", "estimator": "vpo", "num_answers": 3}],
        "evaluation": {"k": [1, 2], "n_samples": 4},
    }
    body.update(sections)
    return body


def write(tmp_path: Path, pipelines: dict[str, Any], **top: Any) -> Path:
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, **top, "pipelines": pipelines}, sort_keys=False))
    return path


def problems(exc: ConfigError) -> dict[str, str]:
    """Map dotted key (line / --set suffix stripped) -> message."""
    return {key.split(" (line")[0].split(" (from --set)")[0]: msg for key, msg in exc.problems}


# --------------------------------------------------------------------------- the shipped file


def test_shipped_file_loads_every_pipeline_and_variant() -> None:
    cfgs = load_all(PIPELINES)
    assert list(cfgs) == ["route", "chat-smollm2", "code-tiny", "code-qwen-coder", "code-qwen-1gpu-lora"]
    assert pipeline_names(PIPELINES)[0] == "route"
    quick = load_all(PIPELINES, quick=True)
    assert quick["route"].quick and not cfgs["route"].quick
    assert not quick["code-qwen-coder"].quick  # no quick section: base config


def test_route_is_the_embedded_default_with_grpo_vpo_compute_matched_and_max_at_k() -> None:
    cfg = load_pipeline(path=PIPELINES)
    assert cfg.name == "route" and cfg.task.name == "route"
    assert cfg.model.builder == "tiny" and cfg.model.path_or_id is None
    arms = {a.name: a for a in cfg.arms}
    assert [a.name for a in cfg.enabled_arms] == ["grpo", "vpo", "grpo_x3", "max_at_k"]
    assert arms["max_at_k"].estimator == "max_at_k" and arms["max_at_k"].num_answers == 1
    assert (arms["grpo"].estimator, arms["grpo"].num_answers) == ("grpo", 1)
    assert (arms["vpo"].estimator, arms["vpo"].num_answers) == ("vpo", 3)
    # compute-matched arm: single answer, as many generated answers per prompt as VPO's m=3
    assert arms["grpo_x3"].num_answers == 1
    assert arms["grpo_x3"].rollouts_per_prompt == arms["vpo"].num_generations * arms["vpo"].num_answers
    off = ["multi_rlvr", "random_weight_grpo", "goal_conditioned", "grpo_passk", "gdpo"]  # the paper's others
    assert [arms[n].enabled for n in off] == [False] * len(off)
    assert cfg.evaluation.k == [1, 3, 5, 10, 30]
    assert cfg.trainer.num_weights == 100 and cfg.trainer.weight_alpha == 1.0


def test_gpu_example_uses_a_hub_model_and_vllm() -> None:
    cfg = load_pipeline("code-qwen-coder", PIPELINES)
    assert cfg.task.name == "code"
    assert cfg.model.path_or_id == "Qwen/Qwen2.5-Coder-7B-Instruct" and not cfg.model.is_local_path
    assert cfg.trainer.use_vllm is True
    assert cfg.resolve_path(cfg.trainer.accelerate_config).is_file()
    assert cfg.storage.registry.startswith("s3://")


def test_route_task_params_build_the_registered_task() -> None:
    from vpo.tasks import available_tasks, get_task

    if "route" not in available_tasks():
        pytest.skip("route task not available")
    for quick in (False, True):
        cfg = load_pipeline("route", PIPELINES, quick=quick)
        task = get_task(cfg.task.name, **cfg.task.params)
        assert task.name == "route"
    assert cfg.task.params["n_train"] == 64 and cfg.task.params["size"] == 5  # quick merged into params


def test_loading_imports_no_prefect_dvc_gx_or_transformers() -> None:
    """Loading checks task parameters against the task's signature and estimator names against the
    estimator registry (so it imports vpo.tasks and torch), but nothing of the orchestration or
    model stack."""
    code = (
        "import sys, vpo.pipeline.config as c; c.load_all(sys.argv[1]); c.load_pipeline('route', sys.argv[1], quick=True);"
        "heavy=('prefect','dvc','great_expectations','transformers','trl','datasets');"
        "print([m for m in sys.modules if m.split('.')[0] in heavy])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(PIPELINES)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_params_are_json_and_round_trip() -> None:
    cfg = load_pipeline("route", PIPELINES)
    data = json.loads(json.dumps(cfg.params()))
    again = PipelineConfig.model_validate(data, context={"base_dir": PIPELINES.parent})
    assert again.params() == cfg.params() and again.arm("vpo") == cfg.arm("vpo")


# --------------------------------------------------------------------------- quick and overrides


def test_quick_overrides_deep_merge_and_merge_arms_by_name() -> None:
    base = load_pipeline("route", PIPELINES)
    quick = load_pipeline("route", PIPELINES, quick=True)
    raw = yaml.safe_load(PIPELINES.read_text())["pipelines"]["route"]["quick"]
    assert quick.trainer.max_steps == raw["trainer"]["max_steps"] < base.trainer.max_steps
    assert quick.trainer.learning_rate == base.trainer.learning_rate  # untouched keys keep the base value
    assert quick.arm("vpo").seeds == [0] and quick.arm("vpo").num_answers == base.arm("vpo").num_answers
    assert quick.arm("multi_rlvr").own_settings() == base.arm("multi_rlvr").own_settings()  # not mentioned
    assert quick.arm("multi_rlvr").num_generations == quick.trainer.num_generations == 4  # inherited
    assert quick.evaluation.n_samples >= max(quick.evaluation.k)


def test_dotted_overrides_apply_last_and_are_validated(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal(quick={"trainer": {"max_steps": 3}})})
    cfg = load_pipeline("p", path, quick=True, overrides={"trainer.learning_rate": 0.1, "arms.vpo.num_answers": 5})
    assert (cfg.trainer.max_steps, cfg.trainer.learning_rate, cfg.arm("vpo").num_answers, cfg.quick) == (3, 0.1, 5, True)
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path, overrides={"trainer.max_steps": "lots"})
    assert "pipelines.p.trainer.max_steps" in problems(err.value)
    with pytest.raises(ConfigError, match="no item named 'nope'"):
        load_pipeline("p", path, overrides={"arms.nope.num_answers": 2})


def test_deep_merge_does_not_mutate_inputs() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "arms": [{"name": "x", "m": 1}]}
    merged = deep_merge(base, {"a": {"b": 2}, "arms": {"x": {"m": 3}}})
    assert merged == {"a": {"b": 2, "c": [1, 2]}, "arms": [{"name": "x", "m": 3}]}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "arms": [{"name": "x", "m": 1}]}


def test_quick_without_section_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal()})
    with pytest.raises(ConfigError, match="no 'quick:' section"):
        load_pipeline("p", path, quick=True)


def test_a_broken_quick_section_fails_even_when_not_requested(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal(quick={"trainer": {"max_steps": 0}})})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    assert "quick" in str(err.value) and "pipelines.p.trainer.max_steps" in problems(err.value)
    assert "greater than 0" in problems(err.value)["pipelines.p.trainer.max_steps"]


def test_quick_arm_that_does_not_exist(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal(quick={"arms": {"ghost": {"num_answers": 2}}})})
    with pytest.raises(ConfigError, match=r"pipelines\.p\.quick\.arms\.ghost: no item named 'ghost'"):
        load_pipeline("p", path)


# --------------------------------------------------------------------------- errors


def test_unknown_key_names_file_pipeline_key_line_and_allowed_keys(tmp_path: Path) -> None:
    body = minimal(trainer={"max_steps": 10, "stpes": 5})
    path = write(tmp_path, {"p": body})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    exc = err.value
    msg = str(exc)
    assert str(path.resolve()) in msg and "pipeline 'p'" in msg
    key, text = next((k, m) for k, m in exc.problems if "stpes" in k)
    assert key.startswith("pipelines.p.trainer.stpes (line ")
    line = int(key.split("line ")[1].rstrip(")"))
    assert "stpes" in path.read_text().splitlines()[line - 1]
    assert text.startswith("unknown key; did you mean max_steps")
    assert "GRPOConfig (https://huggingface.co/docs/trl/" in text and "accelerate_config" in text
    assert exc.file == str(path.resolve()) and exc.pipeline == "p"


def test_wrong_types_are_named_with_expectation(tmp_path: Path) -> None:
    body = minimal(
        trainer={"learning_rate": "fast", "weight_sampler": "grid"},
        arms=[{"name": "grpo", "estimator": "ppo", "num_answers": "three"}],
    )
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": body}))
    found = problems(err.value)
    assert (
        "valid number" in found["pipelines.p.trainer.learning_rate"]
        and "'fast' (str)" in found["pipelines.p.trainer.learning_rate"]
    )
    assert "'dirichlet' or 'sobol'" in found["pipelines.p.trainer.weight_sampler"]
    assert (
        "'vpo'" in found["pipelines.p.arms[0].estimator"]
        and "'ppo'" in found["pipelines.p.arms[0].estimator"]
    )
    assert "valid integer" in found["pipelines.p.arms[0].num_answers"]
    assert len(err.value.problems) == 4  # every problem at once, one exception


def test_missing_required_section(tmp_path: Path) -> None:
    body = minimal()
    del body["task"]
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": body}))
    assert problems(err.value) == {"pipelines.p.task": "required key is missing"}


def test_missing_local_model_path_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal(model={"path_or_id": "./models/policy"})})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    msg = problems(err.value)["pipelines.p.model.path_or_id"]
    assert "does not exist" in msg and str(tmp_path / "models" / "policy") in msg


def test_local_model_path_resolves_against_the_file_and_needs_a_config(tmp_path: Path) -> None:
    model_dir = tmp_path / "models" / "policy"
    model_dir.mkdir(parents=True)
    path = write(tmp_path, {"p": minimal(model={"path_or_id": "./models/policy"})})
    with pytest.raises(ConfigError, match="not a model folder"):
        load_pipeline("p", path)
    (model_dir / "config.json").write_text("{}")
    cfg = load_pipeline("p", path)
    assert cfg.model.is_local_path and cfg.resolve_path(cfg.model.path_or_id) == model_dir


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ({"builder": "tiny", "path_or_id": "org/name"}, "exactly one"),
        ({}, "exactly one"),
        ({"builder": "huge"}, "'tiny'"),
        ({"path_or_id": "hf://org/name"}, "got URL"),
        ({"path_or_id": "bad id!"}, "hub id"),
    ],
)
def test_model_section_errors(tmp_path: Path, model: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": minimal(model=model)}))
    assert any(key.startswith("pipelines.p.model") and fragment in msg for key, msg in err.value.problems), (
        err.value
    )


@pytest.mark.parametrize(
    ("storage", "fragment"),
    [
        ({"registry": "s3://AB/reg"}, "valid bucket name"),
        ({"registry": "gs://bucket/reg"}, "local path or an s3:// URL"),
        ({"dvc_remote": "s3://user:pass@bucket/x"}, "must not embed credentials"),
    ],
)
def test_storage_url_errors(tmp_path: Path, storage: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_pipeline("p", write(tmp_path, {"p": minimal(storage=storage)}))


def test_semantic_cross_field_checks(tmp_path: Path) -> None:
    body = minimal(
        evaluation={"k": [1, 5, 10], "n_samples": 5},
        arms=[{"name": "a", "estimator": "grpo"}, {"name": "a", "estimator": "vpo", "seeds": [1, 1]}],
        trainer={"use_vllm": True, "vllm_mode": "server"},
    )
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": body}))
    found = problems(err.value)
    assert "largest k (10)" in found["pipelines.p.evaluation"]
    assert "seeds must be unique" in found["pipelines.p.arms[1].seeds"]
    assert "vllm_server_base_url" in found["pipelines.p.trainer"]


def test_duplicate_arm_names_and_all_disabled(tmp_path: Path) -> None:
    dup = minimal(arms=[{"name": "a", "estimator": "grpo"}, {"name": "a", "estimator": "vpo"}])
    with pytest.raises(ConfigError, match="duplicated: a"):
        load_pipeline("p", write(tmp_path, {"p": dup}))
    off = minimal(arms=[{"name": "a", "estimator": "grpo", "enabled": False}])
    with pytest.raises(ConfigError, match="at least one arm must be enabled"):
        load_pipeline("p", write(tmp_path, {"p": off}))


def test_renamed_and_moved_keys_say_where_they_went(tmp_path: Path) -> None:
    body = minimal(trainer={"steps": 3, "lr": 0.1}, dataset={"source": "data/rows.parquet"},
                   arms=[{"name": "vpo", "estimator": "vpo", "m": 3}])
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": body}))
    found = problems(err.value)
    assert found["pipelines.p.trainer.steps"] == "unknown key: now max_steps"
    assert found["pipelines.p.trainer.lr"] == "unknown key: now learning_rate"
    assert found["pipelines.p.arms[0].m"] == "unknown key: now num_answers"
    assert found["pipelines.p.dataset.source"].startswith("unknown key: now task.params.source")


def test_missing_file_unknown_pipeline_bad_yaml_and_bad_top_level(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found") as err:
        load_pipeline("p", tmp_path / "nope.yaml")
    assert "nope.yaml" in str(err.value)
    path = write(tmp_path, {"p": minimal()})
    with pytest.raises(ConfigError, match=r"no pipeline named 'q'; defined: p"):
        load_pipeline("q", path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\npipelines:\n  p: {task: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: line \d+"):
        load_pipeline("p", broken)
    with pytest.raises(
        ConfigError, match=r"extra \(line \d+\): unknown key; allowed keys: version, default, pipelines"
    ):
        load_pipeline("p", write(tmp_path, {"p": minimal()}, extra=1))
    with pytest.raises(ConfigError, match="default pipeline 'zzz' is not defined; defined: p"):
        load_pipeline("p", write(tmp_path, {"p": minimal()}, default="zzz"))


def test_name_inside_body_must_match_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must match the key"):
        load_pipeline("p", write(tmp_path, {"p": minimal(name="other")}))


def test_load_all_reports_problems_of_every_pipeline_together(tmp_path: Path) -> None:
    path = write(
        tmp_path, {"a": minimal(sft={"steps": -1}), "b": minimal(trainer={"beta": -0.5}), "c": minimal()}
    )
    with pytest.raises(ConfigError) as err:
        load_all(path)
    keys = {k.split(" (line")[0] for k, _ in err.value.problems}
    assert keys == {"pipelines.a.sft.steps", "pipelines.b.trainer.beta"}
    assert load_pipeline("c", path).name == "c"  # a single good pipeline still loads


# --------------------------------------------------------------------------- strictness


def test_duplicate_keys_are_errors_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "pipelines.yaml"
    path.write_text("version: 1\npipelines:\n  p:\n    task: {name: route}\n    model: {builder: tiny}\n"
                    "    arms: [{name: g, estimator: grpo}]\n    trainer:\n      max_steps: 3\n"
                    "      max_steps: 30\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    (key, msg), = err.value.problems
    assert key == "pipelines.p.trainer.max_steps (line 9)"
    assert "duplicate key: already set on line 8" in msg


@pytest.mark.parametrize(("section", "value", "expected"), [
    ({"trainer": {"max_steps": True}}, "pipelines.p.trainer.max_steps", "valid integer, got True (bool)"),
    ({"trainer": {"learning_rate": float("inf")}}, "pipelines.p.trainer.learning_rate", "finite number"),
    ({"trainer": {"max_steps": "10"}}, "pipelines.p.trainer.max_steps", "valid integer, got '10' (str)"),
    ({"storage": {"runs_dir": ""}}, "pipelines.p.storage.runs_dir", "at least 1 character"),
    ({"storage": {"runs_dir": "."}}, "pipelines.p.storage.runs_dir", "need a folder of their own"),
    ({"search": {"params": {"n_problems": 3}}}, "pipelines.p.search.params", "now search.n_problems"),
])
def test_no_coercion_no_infinities_no_repo_root_runs(tmp_path: Path, section: dict[str, Any], value: str,
                                                     expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": minimal(**section)}))
    assert expected in problems(err.value)[value]


def test_task_params_are_checked_by_the_tasks_own_signature(tmp_path: Path) -> None:
    body = minimal(task={"name": "route", "params": {"n_wals": [1, 2], "size": True, "hidden_sides": 3}})
    path = write(tmp_path, {"p": body})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    found = problems(err.value)
    assert found["pipelines.p.task.params.n_wals"].startswith("unknown parameter of task 'route'; parameters: size")
    assert found["pipelines.p.task.params.size"] == "expected a valid integer, got True (bool)"
    assert "valid string" in found["pipelines.p.task.params.hidden_sides"]
    lines = {key.split(" (line")[0]: key for key, _ in err.value.problems}
    assert lines["pipelines.p.task.params.n_wals"].endswith(")")  # every problem carries its line
    with pytest.raises(ConfigError, match=r"unknown task 'maze'; tasks: code, .*route"):
        load_pipeline("p", write(tmp_path, {"p": minimal(task={"name": "maze"})}))


def test_task_value_errors_found_when_the_task_is_built_name_the_parameter_line(tmp_path: Path) -> None:
    from vpo.pipeline.engine.context import build_task

    body = minimal(task={"name": "code", "params": {"source": "missing/problems.jsonl"}})
    cfg = load_pipeline("p", write(tmp_path, {"p": body}))  # types are fine: the file is checked on build
    with pytest.raises(ConfigError) as err:
        build_task(cfg)
    (key, msg), = err.value.problems
    assert key.startswith("pipelines.p.task.params.source (line ") and "does not exist" in msg


def test_arms_may_be_a_mapping_by_name(tmp_path: Path) -> None:
    body = minimal(arms={"grpo": {"estimator": "grpo"}, "vpo": {"estimator": "vpo", "num_answers": 3}})
    cfg = load_pipeline("p", write(tmp_path, {"p": body}))
    assert [a.name for a in cfg.arms] == ["grpo", "vpo"] and cfg.arm("vpo").num_answers == 3
    assert list(cfg.settings()["arms"]) == ["grpo", "vpo"]


def test_local_model_path_is_resolved_against_the_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    model = tmp_path / "models" / "policy"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    cfg = load_pipeline("p", write(tmp_path, {"p": minimal(model={"path_or_id": "./models/policy"})}))
    monkeypatch.chdir(tmp_path.parent)  # another working directory
    assert cfg.model_source == str(model.resolve())
    hub = load_pipeline("p", write(tmp_path, {"p": minimal(model={"path_or_id": "org/model"})}))
    assert hub.model_source == "org/model"


def test_cli_args_load_the_same_config(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal(quick={"trainer": {"max_steps": 2}})})
    cfg = load_pipeline("p", path, quick=True, overrides={"trainer.learning_rate": 0.01, "arms.vpo.seeds": [1, 2]})
    from vpo.pipeline.cli import _load, _parser

    again = _load(_parser().parse_args(["stage", "data", *cfg.cli_args()]))
    assert again.settings() == cfg.settings() and again.quick and again.variant == "p-quick"


# --------------------------------------------------------------------------- params.yaml (what DVC stages read)


def test_params_yaml_variant_loads_as_the_pipeline_and_goes_stale_with_it(tmp_path: Path) -> None:
    from vpo.pipeline.dvc.generate import params_yaml_text
    from vpo.pipeline.dvc.params import load_variant

    path = write(tmp_path, {"p": minimal(quick={"trainer": {"max_steps": 2}})})
    params = tmp_path / "params.yaml"
    params.write_text(params_yaml_text(path, ["p", "p-quick"]))
    cfg = load_variant("p-quick", params, config_path=path)
    assert cfg.settings() == load_pipeline("p", path, quick=True).settings() and cfg.variant == "p-quick"
    # an experiment edits params.yaml (dvc exp run -S): allowed, and what runs
    data = yaml.safe_load(params.read_text())
    data["p-quick"]["trainer"]["max_steps"] = 7
    params.write_text(yaml.safe_dump(data))
    assert load_variant("p-quick", params, config_path=path).trainer.max_steps == 7
    # pipelines.yaml edited without regenerating: refused, not silently run with old settings
    write(tmp_path, {"p": minimal(quick={"trainer": {"max_steps": 3}})})
    with pytest.raises(ConfigError, match=r"generated from another version .* regenerate it"):
        load_variant("p-quick", params, config_path=path)
    with pytest.raises(ConfigError, match=r"no variant named .q. in this file; variants: p, p-quick"):
        load_variant("q", params, config_path=path)


def test_estimator_settings_belong_to_their_estimator(tmp_path: Path) -> None:
    ok = minimal(arms=[{"name": "g", "estimator": "grpo", "scale_rewards": "batch"},
                       {"name": "m", "estimator": "max_at_k", "max_at_k_k": 3}])
    cfg = load_pipeline("p", write(tmp_path, {"p": ok}))
    assert cfg.arm("g").scale_rewards == "batch" and cfg.arm("m").max_at_k_k == 3
    bad = minimal(arms=[{"name": "v", "estimator": "vpo", "max_at_k_k": 3},
                        {"name": "w", "estimator": "vpo", "scale_rewards": "none"}])
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": bad}))
    found = problems(err.value)
    assert "applies to estimator max_at_k only" in found["pipelines.p.arms[0].max_at_k_k"]
    assert "applies to estimator grpo (TRL's GRPO) only" in found["pipelines.p.arms[1].scale_rewards"]
    # inherited from the trainer: named at the trainer's key, with the arm that cannot take it
    inherited = minimal(trainer={"scale_rewards": "batch"})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": inherited}))
    assert "(arm 'vpo'); set it on the grpo arms" in problems(err.value)["pipelines.p.trainer.scale_rewards"]


# --------------------------------------------------------------------------- trainer: any VPOConfig field


def test_unknown_trainer_key_is_one_error_with_the_closest_names(tmp_path: Path) -> None:
    path = write(tmp_path, {"p": minimal(trainer={"lr_schedular_type": "cosine", "vllm_gpu_memory": 0.5})})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    found = problems(err.value)
    assert found["pipelines.p.trainer.lr_schedular_type"].startswith("unknown key; did you mean lr_scheduler_type")
    assert "did you mean vllm_gpu_memory_utilization?" in found["pipelines.p.trainer.vllm_gpu_memory"]
    assert all(key.split("(line ")[1].rstrip(")").isdigit() for key, _ in err.value.problems)


def test_arms_take_any_field_and_inherit_the_trainers(tmp_path: Path) -> None:
    body = minimal(trainer={"top_p": 0.9, "num_generations": 4, "per_device_train_batch_size": 8},
                   arms=[{"name": "grpo", "estimator": "grpo", "top_p": 0.5, "epsilon_high": 0.28},
                         {"name": "vpo", "estimator": "vpo", "num_answers": 3}])
    cfg = load_pipeline("p", write(tmp_path, {"p": body}))
    assert (cfg.arm("grpo").top_p, cfg.arm("vpo").top_p, cfg.arm("vpo").num_generations) == (0.5, 0.9, 4)
    assert cfg.arm("grpo").own_settings() == {"estimator": "grpo", "top_p": 0.5, "epsilon_high": 0.28}
    assert cfg.settings()["arms"]["vpo"] == {"estimator": "vpo", "num_answers": 3}
    # a trainer-wide pipeline setting is not per arm, an arm's identity not trainer-wide
    bad = minimal(trainer={"seeds": [1]}, arms=[{"name": "a", "estimator": "grpo", "accelerate_config": "x.yaml"}])
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": bad}))
    found = problems(err.value)
    assert found["pipelines.p.trainer.seeds"] == "a setting of each arm: arms.<name>.seeds"
    assert found["pipelines.p.arms[0].accelerate_config"] == "a setting of the whole pipeline: trainer.accelerate_config"


@pytest.mark.parametrize(("trainer", "key", "fragment"), [
    ({"seed": 3}, "trainer.seed", "set by the pipeline, not in the config: set per run from arms.<name>.seeds"),
    ({"hub_token": "hf_x"}, "trainer.hub_token", "a secret: give it as HF_TOKEN in the environment"),
    ({"prompts_per_step": 8}, "trainer.prompts_per_step", "unknown key: now per_device_train_batch_size, TRL's"),
    ({"top_p": "high"}, "trainer.top_p", "expected a valid number, got 'high' (str)"),
    ({"gradient_checkpointing": 1}, "trainer.gradient_checkpointing", "expected a valid boolean, got 1 (int)"),
    ({"lr_scheduler_type": "cosin"}, "trainer.lr_scheduler_type", "expected 'linear', 'cosine',"),
    ({"lr_scheduler_kwargs": 3}, "trainer.lr_scheduler_kwargs",
     "expected a mapping or a valid string, got 3 (int)"),
    ({"num_generations": 1}, "trainer.num_generations", "expected greater than or equal to 2"),
    ({"top_p": float("nan")}, "trainer.top_p", "expected a finite number"),
    ({"weight_sampler": "grid"}, "trainer.weight_sampler", "expected 'dirichlet' or 'sobol'"),
    ({"loss_type": "ppo"}, "trainer.loss_type", "expected 'grpo', 'dr_grpo', 'dapo', 'bnpo', 'cispo', 'sapo', 'luspo'"),
    ({"estimator": "vpo"}, "trainer.estimator", "a setting of each arm: arms.<name>.estimator"),
    ({"parallelism_config": {"dp": 2}}, "trainer.parallelism_config", "a Python object, it cannot be set"),
])
def test_vpoconfig_fields_are_typed_by_the_dataclass(tmp_path: Path, trainer: dict[str, Any], key: str,
                                                     fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", write(tmp_path, {"p": minimal(trainer=trainer)}))
    found = problems(err.value)
    assert fragment in found[f"pipelines.p.{key}"], found
    assert len(err.value.problems) == 1


def test_learning_rates_as_users_write_them(tmp_path: Path) -> None:
    """`1e-4` (a string to YAML 1.1) is a number, in the file and on the command line."""
    from vpo.pipeline.cli import parse_overrides

    path = tmp_path / "pipelines.yaml"
    path.write_text("version: 1\npipelines:\n  p:\n    task: {name: route}\n    model: {builder: tiny}\n"
                    "    arms: [{name: g, estimator: grpo}]\n    trainer: {learning_rate: 1e-4, beta: 5E-3}\n")
    cfg = load_pipeline("p", path)
    assert (cfg.trainer.learning_rate, cfg.trainer.beta) == (1e-4, 5e-3)
    overrides = parse_overrides(["trainer.learning_rate=1e-4", "trainer.max_steps=3", "trainer.run_name=1e3x"])
    assert overrides == {"trainer.learning_rate": 1e-4, "trainer.max_steps": 3, "trainer.run_name": "1e3x"}
    assert load_pipeline("p", path, overrides=overrides).arm("g").learning_rate == 1e-4


def test_a_file_that_is_not_utf8_is_one_error_naming_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "pipelines.yaml"
    path.write_bytes(b"version: 1\npipelines:\n  p:\n    description: caf\xe9\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path)
    assert err.value.problems == [("", "not UTF-8 text: byte 0xe9 at line 4, column 21; save the file as UTF-8")]


def test_values_from_set_are_named_as_such_not_by_a_file_line(tmp_path: Path) -> None:
    """A --set value is reported as coming from the command line, and the task is built at load when
    --set changed it: a missing data file is found before any stage runs."""
    path = write(tmp_path, {"p": minimal(task={"name": "code", "params": {"max_tests": 4}})})
    with pytest.raises(ConfigError) as err:
        load_pipeline("p", path, overrides={"task.params.source": "missing/problems.jsonl"})
    (key, msg), = err.value.problems
    assert key == "pipelines.p.task.params.source (from --set)" and "does not exist" in msg
    assert "with --set" in str(err.value)
    cfg = load_pipeline("p", path, overrides={"task.params.max_tests": 3})
    (key, _), = cfg.problem(("task", "params", "max_tests"), "too few").problems
    assert key == "pipelines.p.task.params.max_tests (from --set)"
    (key, _), = cfg.problem(("task", "name"), "x").problems
    assert key.startswith("pipelines.p.task.name (line ")


def test_explicit_settings_are_small_and_round_trip_through_params(tmp_path: Path) -> None:
    """params.yaml holds what a variant sets (not TRL's defaults), arms apart from their runs."""
    from vpo.pipeline.dvc.generate import params_yaml_text
    from vpo.pipeline.dvc.params import load_variant

    path = write(tmp_path, {"p": minimal(trainer={"top_p": 0.9}, quick={"trainer": {"max_steps": 2}})})
    params = tmp_path / "params.yaml"
    params.write_text(params_yaml_text(path, ["p-quick"]))
    entry = yaml.safe_load(params.read_text())["p-quick"]
    assert entry["trainer"] == {"max_steps": 2, "top_p": 0.9}
    assert entry["arms"] == {"grpo": {"estimator": "grpo"}, "vpo": {"estimator": "vpo", "num_answers": 3}}
    assert "runs" not in entry and "description" not in entry and "None" not in params.read_text()
    cfg = load_variant("p-quick", params, config_path=path)
    assert cfg.settings() == load_pipeline("p", path, quick=True).settings()
    assert cfg.trainer.lr_scheduler_type == "constant" and cfg.settings()["trainer"]["lr_scheduler_type"] == "constant"


# --------------------------------------------------------------------------- start-up errors through the CLI


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[Any, str]:
    """``vpo ARGV`` in this process: (exit code, stderr)."""
    from vpo.pipeline.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _one_error_line(err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize("argv", [["run", "--quick"], ["stage", "data"], ["flow"], ["pipelines"], ["dvc"],
                                  ["stage", "data", "--variant", "route-quick"]])
def test_a_non_utf8_pipelines_yaml_is_one_error_line_everywhere(tmp_path: Path, argv: list[str],
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pipelines.yaml").write_bytes(b"version: 1\npipelines:\n  route:\n    description: caf\xe9\n")
    (tmp_path / "params.yaml").write_bytes(b"route-quick:\n  seed: \xff\n")
    monkeypatch.chdir(tmp_path)
    code, err = _cli(argv, capsys)
    assert code == 2
    _one_error_line(err, "not UTF-8 text: byte 0x")


def test_registry_with_its_url_does_not_read_pipelines_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pipelines.yaml").write_bytes(b"version: 1\npipelines:\n  route: {description: caf\xe9}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VPO_REGISTRY", raising=False)
    import vpo.pipeline.config as config_module

    def no_read(*args: Any, **kw: Any) -> Any:
        raise AssertionError("pipelines.yaml was read although --registry names the registry")

    monkeypatch.setattr(config_module, "load_pipeline", no_read)
    (tmp_path / "reg").mkdir()
    code, err = _cli(["registry", "--registry", str(tmp_path / "reg"), "list"], capsys)
    assert code == 0 and "error" not in err, err


@pytest.mark.parametrize("where", ["lock", "log"])
def test_a_full_disk_at_start_is_one_error_line(tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No space for the run lock's record or the command's log file: exit 2, "disk full at <path>"."""
    import builtins
    import errno
    import os

    path = write(tmp_path, {"route": minimal(quick={"trainer": {"max_steps": 2}})})
    monkeypatch.chdir(tmp_path)
    if where == "lock":
        def pwrite(*args: Any, **kw: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", pwrite)
    else:
        real_open = builtins.open

        def full_open(file: Any, *args: Any, **kw: Any) -> Any:
            if str(file).endswith(".log"):
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            return real_open(file, *args, **kw)

        monkeypatch.setattr(builtins, "open", full_open)
    code, err = _cli(["run", "--quick", "--config", str(path)], capsys)
    assert code == 2
    _one_error_line(err, "error: disk full at ", "No space left on device", "free space and run `", "vpo run --quick --config")
    expected = tmp_path / "runs" / "route-quick" / ("logs" if where == "log" else "")
    assert f"disk full at {expected}" in err


def test_a_bad_set_task_source_fails_at_load_naming_the_command_line(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"p": minimal(task={"name": "code", "params": {"max_tests": 4}})})
    code, err = _cli(["stage", "data", "--config", str(path), "--pipeline", "p", "--set",
                      "task.params.source=nope.jsonl"], capsys)
    assert code == 2
    _one_error_line(err, "pipelines.p.task.params.source (from --set)", "nope.jsonl does not exist")
    assert "(line " not in err and "running" not in err


@pytest.mark.parametrize("override", ["route-quick.trainer.max_steps=7", "route-quick.task.params.n_walls=[1,3]",
                                      "route-quick.arms.vpo.max_completion_length=90",
                                      "+route-quick.trainer.top_p=0.9", "route-quick.trainer.learning_rate=1e-5"])
def test_dvcs_own_rewrite_of_params_yaml_changes_one_line(tmp_path: Path, override: str) -> None:
    """`dvc exp run -S` rewrites params.yaml with DVC's YAML round trip: the committed file is laid out
    the way it writes back, so one changed value is a one-line diff (a new key: one added line)."""
    import difflib

    from dvc.utils.hydra import apply_overrides

    from vpo.pipeline.config import load_yaml
    from vpo.pipeline.dvc.params import load_variant

    committed = (REPO / "params.yaml").read_text(encoding="utf-8")
    params = tmp_path / "params.yaml"
    params.write_text(committed, encoding="utf-8")
    (tmp_path / "pipelines.yaml").write_text(PIPELINES.read_text(encoding="utf-8"), encoding="utf-8")
    apply_overrides(str(params), [override])
    diff = [ln for ln in difflib.unified_diff(committed.splitlines(), params.read_text(encoding="utf-8").splitlines(),
                                              lineterm="", n=0) if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert len(diff) == (1 if override.startswith("+") else 2), diff
    cfg = load_variant("route-quick", params, config_path=tmp_path / "pipelines.yaml")  # and it still loads
    key, value = override.lstrip("+").split("=")
    node: Any = cfg.settings()
    for part in key.split(".")[1:]:
        node = node[part]
    assert node == load_yaml(value)  # DVC writes 1e-05, which YAML 1.1 alone would read as a string
