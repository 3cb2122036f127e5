"""The memory and throughput plan: its terms against what torch builds and saves, TRL's batch rule and
FLOP count, sharding, LoRA, the refusal naming the setting, the shipped model configs, the GPU presets
and ``vpo plan``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from vpo.memory import (
    DEVICES,
    Device,
    GiB,
    LoraShape,
    ModelShape,
    Parallel,
    PlanError,
    TrainSettings,
    check,
    plan_step,
    scale_shape,
    shape_config,
)
from vpo.pipeline.memory import MODEL_CONFIGS, shipped_config

REPO = Path(__file__).resolve().parents[1]
CPU = Device("test CPU", 16 * GiB, "cpu", 50e9)
H100 = DEVICES["h100-80gb"]


def shipped(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((MODEL_CONFIGS / f"{name}.json").read_text()), name=name)


def tiny(model_type: str = "llama", **kw: Any) -> ModelShape:
    base = {"model_type": model_type, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": True, **kw}
    return ModelShape.from_config(base, name=f"tiny-{model_type}")


def build(shape: ModelShape) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape_config(shape)), dtype=torch.float32)


def settings(**kw: Any) -> TrainSettings:
    """Settings with TRL's defaults, except float32 weights and no gradient checkpointing (what the tiny
    models these tests build train with)."""
    base: dict[str, Any] = {
        "per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 256, "max_prompt_length": 256,
        "gradient_accumulation_steps": 1, "generation_batch_size": None, "steps_per_generation": None,
        "num_iterations": 1, "gradient_checkpointing": False, "bf16": False, "fp16": False, "param_dtype": "float32",
        "use_vllm": False, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "vllm_enable_sleep_mode": False,
        "beta": 0.0, "optim": "adamw_torch_fused", "ds3_gather_for_generation": True, "cast_lm_head_to_fp32": False}
    return TrainSettings(**{**base, **kw})


# ------------------------------------------------------------------------------------------ shape


@pytest.mark.parametrize(("name", "expected"), [
    ("SmolLM2-135M-Instruct", 134_515_008),      # the GGUF import's parameter count
    ("Qwen2.5-0.5B-Instruct", 494_032_768),      # published: 0.49B
    ("Qwen2.5-Coder-1.5B-Instruct", 1_543_714_304),  # published: 1.54B
    ("Qwen2.5-Coder-7B-Instruct", 7_615_616_512),    # published: 7.61B
])
def test_shipped_configs_give_the_published_parameter_counts(name: str, expected: int) -> None:
    assert shipped(name).parameters == expected


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_built_model(model_type: str, tied: bool) -> None:
    shape = tiny(model_type, tie_word_embeddings=tied)
    model = build(shape)
    assert shape.parameters == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_scaled_shape_builds_the_same_architecture_smaller() -> None:
    big = shipped("Qwen2.5-0.5B-Instruct")
    small = scale_shape(big, layers=2, hidden=128)
    assert (small.num_layers, small.hidden_size, small.model_type) == (2, 128, "qwen2")
    assert small.num_heads % small.num_kv_heads == 0 and small.head_dim * small.num_heads == 128
    assert small.parameters < big.parameters / 10


def _saved_bytes(shape: ModelShape, batch: int, seq: int, checkpointing: bool) -> int:
    """Bytes autograd keeps after a training forward of the backbone (parameters excluded)."""
    model = build(shape)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    ids = torch.randint(0, shape.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_activation_term_matches_the_tensors_autograd_saves(model_type: str) -> None:
    shape = tiny(model_type, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)
    batch, seq = 4, 96
    saved = _saved_bytes(shape, batch, seq, checkpointing=False)
    tokens = batch * seq
    predicted = shape.num_layers * tokens * shape.activation_bytes_per_token_layer(4) + tokens * 12 * shape.hidden_size
    assert predicted == pytest.approx(saved, rel=0.12)


def test_checkpointing_keeps_one_hidden_vector_per_token_and_layer() -> None:
    shape = tiny(hidden_size=128, intermediate_size=352, num_hidden_layers=4)
    batch, seq = 4, 64
    with_gc = _saved_bytes(shape, batch, seq, checkpointing=True)
    without = _saved_bytes(shape, batch, seq, checkpointing=False)
    tokens = batch * seq
    # each layer's input, plus the final norm outside the checkpointed layers
    assert with_gc == pytest.approx((shape.num_layers + 2) * tokens * shape.hidden_size * 4, rel=0.1)
    assert with_gc < without / 5


def test_training_flops_match_trls_count() -> None:
    from transformers import AutoConfig
    from trl.trainer.utils import compute_flops_per_token

    for name in ("SmolLM2-135M-Instruct", "Qwen2.5-Coder-7B-Instruct"):
        shape = shipped(name)
        config = AutoConfig.for_model(**shape_config(shape))
        mine = 3 * shape.forward_flops_per_token(context=2048)  # TRL: non-causal, every token sees seq_len
        assert mine == pytest.approx(compute_flops_per_token(config, 2048), rel=0.01)


# ------------------------------------------------------------------------------------ batch rule


@pytest.mark.parametrize(("kw", "world"), [
    ({}, 1), ({"gradient_accumulation_steps": 4}, 2), ({"steps_per_generation": 2}, 3),
    ({"generation_batch_size": 48, "gradient_accumulation_steps": 2}, 2),
])
def test_the_batch_is_trls_rule(kw: dict[str, Any], world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl import GRPOConfig

    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: world))
    cfg = GRPOConfig(output_dir="/tmp/unused", per_device_train_batch_size=8, num_generations=4, bf16=False,
                     use_cpu=True, report_to="none", **kw)
    mine = settings(num_generations=4, **kw).batch(world)
    assert (mine.completions_per_round, mine.steps_per_generation) == (cfg.generation_batch_size,
                                                                       cfg.steps_per_generation)
    batch_keys = ("per_device_train_batch_size", "num_generations", "gradient_accumulation_steps",
                  "generation_batch_size", "steps_per_generation", "num_iterations")
    built = settings(**{k: getattr(cfg, k) for k in batch_keys}).batch(world)
    assert built == mine  # a built config (both round settings) plans the same batch


def test_indivisible_generation_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="does not hold whole groups of num_generations 4"):
        plan_step(tiny(), settings(per_device_train_batch_size=6, num_generations=4), device=CPU)


# -------------------------------------------------------------------------------- sharding, LoRA


def test_zero_and_fsdp_shard_what_they_should() -> None:
    shape = shipped("Qwen2.5-Coder-7B-Instruct")
    s = settings(bf16=True, param_dtype="bfloat16", gradient_checkpointing=True, per_device_train_batch_size=2,
                 num_generations=2)
    single = plan_step(shape, s, device=H100).components
    z1 = plan_step(shape, s, parallel=Parallel(8, 1), device=H100).components
    z2 = plan_step(shape, s, parallel=Parallel(8, 2), device=H100).components
    z3 = plan_step(shape, s, parallel=Parallel(8, 3), device=H100).components
    fsdp = plan_step(shape, s, parallel=Parallel(8, fsdp=True), device=H100).components
    n = shape.parameters
    assert single["optimizer"] == 2 * n * 2  # bf16 weights: bf16 AdamW moments, no master copy
    assert z1["optimizer"] == pytest.approx(12 * n / 8, rel=1e-6)  # fp32 master + moments, sharded
    assert z1["weights"] == z2["weights"] == 2 * n
    assert z2["gradients"] < z1["gradients"] < single["gradients"] + 4 * n
    assert z3["weights"] < z2["weights"] / 3  # an eighth, plus two gathered layers and the LM head
    assert fsdp["weights"] < z2["weights"] / 2 and fsdp["optimizer"] == pytest.approx(8 * n / 8, rel=1e-6)


def test_lora_parameter_count_matches_peft_and_freezes_the_base() -> None:
    from peft import LoraConfig, get_peft_model

    shape = tiny(hidden_size=96, intermediate_size=256)
    targets = ("q_proj", "v_proj", "down_proj")
    model = get_peft_model(build(shape), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    lora = LoraShape(r=4, alpha=8, target_modules=targets)
    assert lora.parameters(shape) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = plan_step(shape, settings(), device=CPU, lora=lora)
    assert plan.trainable == lora.parameters(shape)
    assert plan.components["optimizer"] == 8 * plan.trainable
    with pytest.raises(ValueError, match="not projections"):
        LoraShape(r=4, target_modules=("c_attn",)).parameters(shape)


def test_lora_needs_far_less_than_a_full_fine_tune() -> None:
    shape = shipped("Qwen2.5-Coder-1.5B-Instruct")
    s = settings(bf16=True, param_dtype="bfloat16", gradient_checkpointing=True)
    full = plan_step(shape, s, device=H100)
    lora = plan_step(shape, s, device=H100, lora=LoraShape(r=16))
    assert lora.components["optimizer"] < full.components["optimizer"] / 20
    assert lora.components["gradients"] < full.components["gradients"] / 20
    assert full.flops["training"] == pytest.approx(lora.flops["training"] * 4 / 3, rel=1e-6)  # 8N vs 6N with GC


def test_vllm_colocate_reserves_its_share_and_drops_the_kv_cache() -> None:
    shape = shipped("Qwen2.5-0.5B-Instruct")
    hf = plan_step(shape, settings(bf16=True, param_dtype="bfloat16"), device=H100)
    vl = plan_step(shape, settings(bf16=True, param_dtype="bfloat16", use_vllm=True,
                                   vllm_gpu_memory_utilization=0.4), device=H100)
    assert hf.components["kv cache"] > 0 and vl.components["kv cache"] == 0
    assert vl.components["vllm"] == int(0.4 * H100.memory)
    sleep = plan_step(shape, settings(bf16=True, param_dtype="bfloat16", use_vllm=True, vllm_enable_sleep_mode=True),
                      device=H100)
    assert sleep.phases["training"]["vllm"] == 0 and sleep.phases["generation"]["vllm"] > 0


# ------------------------------------------------------------------------------------- refusing


def test_refusal_names_the_batch_and_checkpointing() -> None:
    shape = shipped("Qwen2.5-Coder-7B-Instruct")
    old = settings(per_device_train_batch_size=256, max_prompt_length=2048, max_completion_length=4096,
                   gradient_accumulation_steps=4, bf16=True, param_dtype="bfloat16", use_vllm=True)
    plan = plan_step(shape, old, parallel=Parallel(8, 2), device=H100)
    assert not plan.fits and plan.peak_phase == "training"
    with pytest.raises(PlanError) as err:
        check(plan, label="code-qwen-coder/vpo", prefix="trainer.")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("code-qwen-coder/vpo: ")
    assert "trainer.per_device_train_batch_size (now 256)" in msg and "trainer.gradient_checkpointing: true" in msg
    with_gc = plan_step(shape, TrainSettings(**{**old.__dict__, "gradient_checkpointing": True}),
                        parallel=Parallel(8, 2), device=H100)
    with pytest.raises(PlanError, match=r"lower trainer.per_device_train_batch_size \(now 256\) \(raise"):
        check(with_gc, prefix="trainer.")


def test_refusal_for_weights_suggests_lora_or_zero3() -> None:
    shape = shipped("Qwen2.5-Coder-7B-Instruct")
    small = Device("24 GB card", 22 * GiB, "cuda", 121e12, 0.3e12)
    plan = plan_step(shape, settings(bf16=True, param_dtype="bfloat16", gradient_checkpointing=True,
                                     per_device_train_batch_size=2, num_generations=2), device=small)
    with pytest.raises(PlanError, match=r"trainer.lora\) or shard the model with ZeRO-3"):
        check(plan, prefix="trainer.")


def test_cpu_plans_must_fit_the_ram_and_say_when_it_is_not_free_now() -> None:
    busy = Device("busy CPU", 16 * GiB, "cpu", 50e9, available=1 * GiB)
    plan = check(plan_step(shipped("SmolLM2-135M-Instruct"), settings(), device=busy))
    assert plan.fits and plan.above_available
    from vpo.memory import format_plan

    assert "1.0 GiB available now" in format_plan(plan) and "more than is free now" in format_plan(plan)
    assert not plan_step(shipped("SmolLM2-135M-Instruct"), settings(), device=CPU).above_available


def test_generation_time_is_bounded_by_the_decode_floor_and_by_bandwidth() -> None:
    from vpo.memory import DECODE_FLOOR_PER_LAYER, known_gpu

    small = shipped("Qwen2.5-0.5B-Instruct")
    s = settings(bf16=True, param_dtype="bfloat16", max_completion_length=512)
    plan = plan_step(small, s, device=H100)
    assert plan.seconds["generation"] >= 512 * small.num_layers * DECODE_FLOOR_PER_LAYER["transformers"]
    big = shipped("Qwen2.5-Coder-7B-Instruct")
    l4 = plan_step(big, settings(bf16=True, param_dtype="bfloat16", per_device_train_batch_size=2,
                                 num_generations=2), device=DEVICES["l4"])
    assert l4.seconds["generation"] >= 256 * big.parameters * 2 / DEVICES["l4"].bandwidth  # weights read per token
    assert known_gpu("NVIDIA H100 80GB HBM3", 85 * 10**9) is DEVICES["h100-80gb"]
    assert known_gpu("NVIDIA A100-SXM4-40GB", 42 * 10**9) is DEVICES["a100-40gb"]
    assert known_gpu("Tesla T4", 16 * 10**9) is None


def test_a_plan_that_fits_passes_and_states_its_step_time() -> None:
    plan = check(plan_step(shipped("SmolLM2-135M-Instruct"), settings(), device=CPU))
    assert plan.fits and plan.peak < CPU.memory and plan.step_seconds > 0
    assert set(plan.flops) == {"generation", "training", "scoring"} and plan.flops["training"] > 0


# ----------------------------------------------------------------------------- pipeline adapter


@pytest.mark.parametrize(("value", "expected"), [
    ("Qwen/Qwen2.5-Coder-7B-Instruct", "Qwen2.5-Coder-7B-Instruct"),
    ("qwen/qwen2.5-0.5b-instruct", "Qwen2.5-0.5B-Instruct"),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("org/unknown-model", None),
])
def test_shipped_config_lookup(value: str, expected: str | None) -> None:
    found = shipped_config(value)
    assert (found.stem if found else None) == expected


@pytest.mark.parametrize(("name", "stage", "fsdp"), [("deepspeed_zero2.yaml", 2, False),
                                                      ("deepspeed_zero3.yaml", 3, False), ("fsdp.yaml", 0, True)])
def test_accelerate_configs_load_and_give_their_sharding(name: str, stage: int, fsdp: bool) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.memory import parallel_of

    path = REPO / "infra" / "accelerate" / name
    load_config_from_file(str(path))  # accelerate itself accepts the file
    cfg = load_pipeline("route", str(REPO / "pipelines.yaml"), quick=True,
                        overrides={"trainer.accelerate_config": f"infra/accelerate/{name}"})
    par = parallel_of(cfg)
    assert (par.zero_stage, par.fsdp, par.world_size) == (stage, fsdp, 8)
    assert parallel_of(cfg, processes=2).world_size == 2


def test_route_plan_reads_the_tiny_builder(tmp_path: Path) -> None:
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.engine.context import build_task
    from vpo.pipeline.memory import model_shape, plan_pipeline

    cfg = load_pipeline("route", str(REPO / "pipelines.yaml"), quick=True,
                        overrides={"storage.runs_dir": str(tmp_path)})
    shape, dtype, source = model_shape(cfg)
    assert dtype == "float32" and "tiny" in source
    assert shape.vocab_size == 4 + len(set(build_task(cfg).charset)) and shape.tie_word_embeddings
    plans = plan_pipeline(cfg, device=CPU)
    assert [label for label, _ in plans] == [f"route/{a.name}" for a in cfg.enabled_arms]
    vpo = dict(plans)["route/vpo"]
    assert vpo.settings.max_completion_length == cfg.arm("vpo").completion_length(cfg.trainer)
    assert vpo.fits


def test_vpo_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vpo.pipeline.cli import main

    args = ["plan", "--config", str(REPO / "pipelines.yaml"), "--pipeline", "route", "--quick",
            "--set", f"storage.runs_dir={tmp_path}", "--device", "l4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "route/vpo" in out and "activations" in out and "peak:" in out and "per step" in out
    assert main([*args, "--memory", "0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("error: route/") for line in err)
    assert "trainer." in err[0]


def test_train_stage_check_refuses_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vpo.pipeline import memory as plan_mod
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.config.layout import ArmRun, RunLayout
    from vpo.pipeline.config.settings import vpo_config_kwargs
    from vpo.pipeline.engine.context import StageContext
    from vpo.pipeline.engine.errors import StageError
    from vpo.trainer import VPOConfig

    cfg = load_pipeline("route", str(REPO / "pipelines.yaml"), quick=True,
                        overrides={"storage.runs_dir": str(tmp_path)})
    layout = RunLayout.of(cfg)
    run = ArmRun(cfg.arm("vpo"), 0)
    ctx = StageContext(cfg, layout, "train", run)
    args = VPOConfig(**vpo_config_kwargs(cfg, run, tmp_path / "t", cuda=False, progress=False))
    monkeypatch.setattr(plan_mod, "local_device", lambda: Device("small CPU", 4 * 1024**2, "cpu", 1e9))
    with pytest.raises(StageError, match=r"trainer\.per_device_train_batch_size .*VPO_MEMORY_PLAN=warn"):
        plan_mod.check_plan(ctx, args)
    monkeypatch.setenv(plan_mod.PLAN_ENV, "warn")
    assert not plan_mod.check_plan(ctx, args).fits


# ---------------------------------------------------------------------------------- GPU presets


def _preset(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    p = doc["pipelines"][name]
    return p, p["trainer"]


@pytest.mark.parametrize(("name", "device"), [("code-qwen-coder", "h100-80gb"), ("code-qwen-1gpu-lora", "l4"),
                                            ("code-qwen-1gpu-lora", "a10g")])
def test_gpu_presets_fit_their_stated_hardware(name: str, device: str) -> None:
    """Read straight from pipelines.yaml (a run's value: the arm's, else the trainer's; the rollout
    multiplier multiplies rollouts and the completion batch), so it holds whatever the schema accepts:
    every arm's plan fits the card the preset names below 90%, with checkpointing on and a micro-batch
    far below the optimizer step."""
    from vpo.pipeline.config.fields import VPOConfigFields

    defaults = {name: f.get_default(call_default_factory=True) for name, f in VPOConfigFields.model_fields.items()}
    preset, trainer = _preset(name)
    model_id = preset["model"]["path_or_id"]
    shape = ModelShape.from_config(json.loads(shipped_config(model_id).read_text()), name=model_id)
    acc = trainer.get("accelerate_config")
    world, stage = 1, 0
    if acc:
        acc_cfg = yaml.safe_load((REPO / acc).read_text())
        world = acc_cfg["num_processes"]
        ds = json.loads((REPO / acc_cfg["deepspeed_config"]["deepspeed_config_file"]).read_text())
        stage = ds["zero_optimization"]["stage"]
    lora = trainer.get("lora")
    assert trainer.get("gradient_checkpointing") is True
    for arm in preset["arms"]:
        if arm.get("enabled") is False:
            continue
        kw = {**defaults, **trainer, **arm}
        mult = arm.get("rollout_multiplier", 1)
        kw["num_generations"] = kw.get("num_generations", 8) * mult
        kw["per_device_train_batch_size"] = kw["per_device_train_batch_size"] * mult
        s = TrainSettings.from_trl(kw, max_prompt_length=trainer["max_prompt_length"], param_dtype="bfloat16")
        plan = plan_step(shape, s, parallel=Parallel(world, stage), device=DEVICES[device],
                         lora=LoraShape(r=lora["r"], alpha=lora["alpha"], target_modules=tuple(lora["target_modules"]))
                         if lora else None)
        assert check(plan).verdict == "fits", (arm["name"], plan.peak / GiB)  # below 90%: room for the error
        assert s.gradient_accumulation_steps * world >= 8  # a micro-batch far below the optimizer step
        assert plan.prompts_per_step >= 6
