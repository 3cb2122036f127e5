"""How the stages load a policy: evaluation and search on the stage's device in the policy's dtype with
one vLLM engine at a time, released before the next policy; the evaluation phase in the memory plan;
the train stage's ``model_init_kwargs`` honoured and recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.configs import write_pipeline
from vpo import generation
from vpo.generation import EngineSlot, load_policy, policy_device
from vpo.memory import device_by_name
from vpo.memory.estimate import PlanError
from vpo.memory.evaluation import check_evaluation, plan_evaluation
from vpo.pipeline import config as C
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.policy import load_train_model, sampling_options, train_load_kwargs
from vpo.tasks.route import route_charset
from vpo.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_tiny_model(tmp_path_factory.mktemp("policy") / "m", route_charset(), seed=0, **SMALL)
    torch.set_num_threads(before)


# ------------------------------------------------------------------ evaluation and search: where, what dtype


def test_the_policy_goes_on_the_first_visible_gpu_else_the_cpu() -> None:
    assert policy_device(cuda=False) == "cpu"
    assert policy_device(cuda=True) == "cuda:0"  # a stage slot's CUDA_VISIBLE_DEVICES makes it its own GPU


def test_sampling_options_follow_the_settings(tmp_path: Path) -> None:
    plain = sampling_options(write_pipeline(tmp_path), cuda=True)
    assert plain == {"backend": "transformers", "load": {"device": "cuda:0", "dtype": "auto"},
                     "engine": {"gpu_memory_utilization": 0.9}}
    cfg = write_pipeline(tmp_path, trainer={"use_vllm": True, "model_init_kwargs": {"dtype": "bfloat16",
                                                                             "attn_implementation": "sdpa"}},
                    evaluation={"vllm_gpu_memory_utilization": 0.6})
    opts = sampling_options(cfg, cuda=False)
    assert opts == {"backend": "vllm", "load": {"device": "cpu", "dtype": "bfloat16", "attn_implementation": "sdpa"},
                    "engine": {"gpu_memory_utilization": 0.6, "dtype": "bfloat16"}}
    with pytest.raises(C.ConfigError, match="vllm_gpu_memory_utilization"):
        write_pipeline(tmp_path, evaluation={"vllm_gpu_memory_utilization": 1.5})


def test_a_changed_sampling_dtype_makes_evaluate_and_search_stale(tmp_path: Path) -> None:
    """Evaluation and search sample in ``model_init_kwargs``' dtype: it is part of their request, so a
    changed dtype re-runs them (not only the train stage, whose request covers all of ``trainer``)."""
    from vpo.pipeline.runner import fingerprint
    from vpo.pipeline.steps import steps_of

    def params(cfg: C.PipelineConfig, name: str) -> dict[str, Any]:
        (step,) = steps_of(cfg, [name])
        return fingerprint(cfg, step).params

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = write_pipeline(tmp_path / "a")
    half = write_pipeline(tmp_path / "b", trainer={"model_init_kwargs": {"dtype": "bfloat16"}})
    for name in ("evaluate", "search"):
        assert params(half, name)["trainer.model_init_kwargs"] == {"dtype": "bfloat16"}
        assert "trainer.model_init_kwargs" not in params(plain, name)  # unset: the request of before
        assert {k: v for k, v in params(half, name).items() if k != "trainer.model_init_kwargs"} == {
            k: v for k, v in params(plain, name).items() if k != "trainer.model_init_kwargs"}


def test_load_policy_puts_the_weights_on_the_device_in_the_dtype(tiny: Path) -> None:
    saved, _ = load_policy(tiny, device="cpu")
    assert saved.dtype == torch.float32 and saved.device == torch.device("cpu")  # "auto": as it was saved
    half, tok = load_policy(tiny, device="cpu", dtype="bfloat16", attn_implementation="eager")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.config._attn_implementation == "eager" and tok.padding_side == "left" and not half.training
    out = generation.sample(str(tiny), None, ["S...aa\n?1>"], n=2, max_new_tokens=4, seed=0,
                            load={"device": "cpu", "dtype": "bfloat16"})
    assert len(out) == 1 and len(out[0]) == 2


def test_one_engine_at_a_time_released_before_the_next_is_built() -> None:
    """The release order of :class:`EngineSlot`. The engines are stand-ins that record what happens to
    them (vLLM needs a GPU): this checks only the slot's order of build and release, nothing of vLLM."""
    events: list[str] = []

    class Engine:
        def __init__(self, key: str, **options: Any) -> None:
            self.key, self.options = key, options
            events.append(f"build {key}")

    slot = EngineSlot(Engine, lambda e: events.append(f"release {e.key}"))
    a = slot.get("/m/a", gpu_memory_utilization=0.5)
    assert slot.get("/m/a", gpu_memory_utilization=0.5) is a  # reused, not rebuilt
    slot.get("/m/b", gpu_memory_utilization=0.5)
    slot.get("/m/b", gpu_memory_utilization=0.7)  # other options: a new engine, the old one released first
    slot.close()
    slot.close()
    assert events == ["build /m/a", "release /m/a", "build /m/b", "release /m/b", "build /m/b", "release /m/b"]
    assert slot.engine is None


@pytest.mark.skipif(generation.vllm_available(), reason="checks the message where vLLM is not installed")
def test_the_vllm_backend_says_how_vllm_is_really_installed(tiny: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        generation.sample(str(tiny), None, ["S\n?1>"], backend="vllm")
    assert str(info.value) == generation.VLLM_MISSING
    assert "vpo[vllm]" not in generation.VLLM_MISSING and "docs/gpu.md" in generation.VLLM_MISSING


# -------------------------------------------------------------------------------- the evaluation phase's plan


def test_evaluation_plan_transformers_terms() -> None:
    from vpo.memory import ModelShape

    model = ModelShape.from_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "tie_word_embeddings": True}, name="m")
    dev = device_by_name("h100-80gb")
    plan = plan_evaluation(model, device=dev, dtype="bfloat16", prompt_tokens=100, completion_tokens=50, rollouts=30,
                           problems=1000, batch_size=256)
    assert plan.sequences == 8 * 30  # 256 // 30 problems at once, 30 rollouts each
    assert plan.components["weights"] == model.parameters * 2
    assert plan.components["kv cache"] == 240 * 150 * model.kv_bytes_per_token(2)
    assert plan.components["logits"] == 240 * 1000 * 4 * 3
    few = plan_evaluation(model, device=dev, dtype="bfloat16", prompt_tokens=100, completion_tokens=50, rollouts=30,
                          problems=2)
    assert few.sequences == 60 and plan.fits and check_evaluation(plan) is plan


def test_evaluation_plan_vllm_budget_and_refusals() -> None:
    from vpo.memory import ModelShape

    config = json.loads((REPO / "vpo/data/model_configs/Qwen2.5-Coder-7B-Instruct.json").read_text())
    model = ModelShape.from_config(config, name="qwen7b")
    dev = device_by_name("h100-80gb")
    plan = plan_evaluation(model, device=dev, dtype="bfloat16", prompt_tokens=2048, completion_tokens=4096,
                           rollouts=30, problems=100, backend="vllm", vllm_gpu_memory_utilization=0.9)
    budget = 0.9 * dev.memory - model.parameters * 2
    assert plan.components == {"vllm": int(0.9 * dev.memory)}
    assert plan.sequences == int(budget // (6144 * model.kv_bytes_per_token(2)))
    small = plan_evaluation(model, device=dev, dtype="bfloat16", prompt_tokens=2048, completion_tokens=4096,
                            rollouts=30, problems=100, backend="vllm", vllm_gpu_memory_utilization=0.15)
    with pytest.raises(PlanError, match="raise evaluation.vllm_gpu_memory_utilization"):
        check_evaluation(small)
    dense = plan_evaluation(model, device=dev, dtype="bfloat16", prompt_tokens=2048, completion_tokens=4096,
                            rollouts=30, problems=100)
    with pytest.raises(PlanError, match="set evaluation.use_vllm"):
        check_evaluation(dense)


def test_vpo_plan_covers_the_evaluation_phase(capsys: pytest.CaptureFixture[str]) -> None:
    from vpo.pipeline.memory import main

    cfg = C.load_pipeline("code-qwen-coder", REPO / "pipelines.yaml")
    main(cfg, device="h100-80gb")
    out = capsys.readouterr().out
    assert ("code-qwen-coder/evaluation (largest policy: grpo, 30 samples per problem): one policy at a time, "
            "bfloat16, vllm on NVIDIA H100 80GB") in out
    assert "vLLM's KV budget" in out and "pre-flight of this environment's packages" in out


def test_vpo_plan_json_holds_what_the_text_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """``vpo plan --json``: every arm's step, the evaluation phase and the pre-flight, as one object."""
    from vpo.pipeline.memory import main

    cfg = C.load_pipeline("code-qwen-coder", REPO / "pipelines.yaml")
    main(cfg, device="h100-80gb")
    text = capsys.readouterr().out
    main(cfg, device="h100-80gb", as_json=True)
    shown = json.loads(capsys.readouterr().out)
    assert [a["label"] for a in shown["arms"]] and all(a["label"] in text for a in shown["arms"])
    ev = shown["evaluation"]
    assert ev["label"] in text and ev["dtype"] == "bfloat16" and ev["backend"] == "vllm"
    assert ev["peak"] == sum(ev["components"].values()) + ev["runtime"] and ev["verdict"] in text
    assert shown["preflight"]["of"] == "packages" and isinstance(shown["preflight"]["problems"], list)
    assert all(line in text for line in shown["preflight"]["problems"])


# ------------------------------------------------------------------------------ the train stage's model_init_kwargs


def test_train_load_kwargs_defaults_and_refusals(tmp_path: Path) -> None:
    cfg = write_pipeline(tmp_path)
    assert train_load_kwargs(cfg, cfg.arm("v"), world=1) == {"dtype": "auto", "device_map": None,
                                                             "trust_remote_code": False}
    cfg = write_pipeline(tmp_path, trainer={"model_init_kwargs": '{"attn_implementation": "sdpa", "device_map": "cpu"}'})
    assert train_load_kwargs(cfg, cfg.arm("v"), world=1)["device_map"] == "cpu"  # one process: legal
    with pytest.raises(StageError, match=r"trainer.model_init_kwargs of pipeline 'p': device_map 'cpu' cannot be "
                                         r"used with 2 processes"):
        train_load_kwargs(cfg, cfg.arm("v"), world=2)
    cfg = write_pipeline(tmp_path, arms=[{"name": "v", "estimator": "vpo", "model_init_kwargs": {"dtype": "float8"}}])
    with pytest.raises(StageError, match=r"arms.v.model_init_kwargs of pipeline 'p': dtype 'float8' is not one of"):
        train_load_kwargs(cfg, cfg.arm("v"), world=1)


def test_the_stage_loads_with_model_init_kwargs_and_records_them(tmp_path: Path, tiny: Path) -> None:
    cfg = write_pipeline(tmp_path, trainer={"model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "eager"}})
    model, record = load_train_model(cfg, cfg.arm("v"), tiny, world=1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    assert record == {"requested": {"dtype": "bfloat16", "attn_implementation": "eager"}, "dtype": "bfloat16",
                      "attn_implementation": "eager", "device_map": None}


def test_a_quick_run_records_how_each_model_was_loaded(quick_repo: Any) -> None:
    """The run's record (metrics.json of every arm run of ``vpo run --quick``) says how the model was
    loaded: the checkpoint's own dtype (nothing requested) and the attention implementation in use."""
    runs = sorted((quick_repo.run / "arms").glob("*/metrics.json"))
    assert runs
    for path in runs:
        init = json.loads(path.read_text())["model_init"]
        assert init["requested"] == {} and init["dtype"] == "float32" and init["device_map"] is None
        assert init["attn_implementation"] in ("sdpa", "eager")
