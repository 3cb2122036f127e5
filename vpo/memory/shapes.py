"""What a memory plan reads: the model's shape, LoRA, the distributed layout, the device and the
trainer settings (under TRL's ``GRPOConfig`` names). Plain numbers, no torch or TRL import."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vpo.trl_batch import Batch, trl_batch

__all__ = ["DEVICES", "DTYPE_BYTES", "Device", "GiB", "LoraShape", "MiB", "ModelShape", "Parallel", "TrainSettings",
           "cpu_flops", "device_by_name", "known_gpu", "ram", "scale_shape", "shape_config"]

GiB = 1024**3
MiB = 1024**2

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer (Llama / Qwen2 / Mistral family) that size memory
    and compute. :meth:`from_config` reads a ``config.json`` dict or a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    max_position_embeddings: int | None = None
    dtype: str | None = None
    name: str = ""

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        """From a ``config.json`` mapping or a ``PretrainedConfig`` (text config of a composite one)."""
        if not isinstance(config, Mapping):
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            config = text.to_dict() if hasattr(text, "to_dict") else vars(text)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if config.get(k) is None]
        if missing:
            raise ValueError(f"model config {name or ''} lacks {', '.join(missing)}: not a decoder-only "
                             "transformer config this plan can size")
        heads = int(config["num_attention_heads"])
        model_type = str(config.get("model_type", "llama"))
        bias = config.get("attention_bias")
        if bias is None:
            bias = model_type == "qwen2"  # Qwen2 has q/k/v biases without saying so in its config
        dtype = config.get("dtype") or config.get("torch_dtype")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            model_type=model_type,
            max_position_embeddings=config.get("max_position_embeddings"),
            dtype=str(dtype) if dtype else None,
            name=name,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one decoder layer, by its module name."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: seven projections, q/k/v biases if any, two RMSNorms."""
        n = sum(a * b for a, b in self.linear_shapes().values())
        if self.attention_bias:
            n += self.q_dim + 2 * self.kv_dim
        return n + 2 * self.hidden_size

    @property
    def embedding_parameters(self) -> int:
        """Input embedding plus the LM head when it is not tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def parameters(self) -> int:
        """All parameters (tied embeddings counted once)."""
        return self.num_layers * self.layer_parameters + self.embedding_parameters + self.hidden_size

    @property
    def matmul_parameters(self) -> int:
        """Parameters a token's forward pass multiplies with, LM head excluded (embedding is a lookup)."""
        return self.num_layers * self.layer_parameters

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache per token of context: K and V of every layer."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def activation_bytes_per_token_layer(self, compute_bytes: int) -> int:
        """What autograd keeps per token in one decoder layer without checkpointing: q, k and v
        repeated to every head, the attention output and its reshaped copy (5 x q_dim), four
        intermediate-size MLP tensors, two RMSNorms (input, normalised fp32, output: 12 bytes per
        hidden unit each, in fp32 or bf16 autocast alike) and the fp32 log-sum-exp per head."""
        return compute_bytes * (5 * self.q_dim + 4 * self.intermediate_size) + 24 * self.hidden_size \
            + 4 * self.num_heads

    def forward_flops_per_token(self, context: float, lm_head: bool = True) -> float:
        """Forward FLOPs of one token attending to ``context`` tokens: 2 x matmul parameters, the
        attention scores and weighted sum (4 x layers x q_dim x context) and the LM head."""
        flops = 2.0 * self.matmul_parameters + 4.0 * self.num_layers * self.q_dim * context
        if lm_head:
            flops += 2.0 * self.vocab_size * self.hidden_size
        return flops


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters of rank ``r`` on the named projections of every layer (peft)."""

    r: int
    alpha: float = 32
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                       "down_proj")

    def parameters(self, model: ModelShape) -> int:
        """Adapter parameters: r x (in + out) per targeted projection per layer."""
        shapes = model.linear_shapes()
        unknown = [t for t in self.target_modules if t not in shapes and t != "all-linear"]
        if unknown:
            raise ValueError(f"LoRA target modules {unknown} are not projections of a {model.model_type} layer "
                             f"({', '.join(shapes)})")
        names = shapes if "all-linear" in self.target_modules else self.target_modules
        return model.num_layers * sum(self.r * sum(shapes[t]) for t in names)


# ------------------------------------------------------------------------------------ distributed


@dataclass(frozen=True)
class Parallel:
    """How the training processes share the model: ``world_size`` processes, DeepSpeed ``zero_stage``
    (0 = none) or ``fsdp`` (full sharding), optimizer/parameter offload to CPU."""

    world_size: int = 1
    zero_stage: int = 0
    fsdp: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    source: str = "single process"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {self.zero_stage}")

    @property
    def deepspeed(self) -> bool:
        return self.zero_stage > 0

    def describe(self) -> str:
        kind = f"ZeRO-{self.zero_stage}" if self.deepspeed else "FSDP" if self.fsdp else "DDP" \
            if self.world_size > 1 else "single process"
        off = " + CPU offload" if self.offload_optimizer or self.offload_params else ""
        return f"{kind}{off}, {self.world_size} process{'es' if self.world_size != 1 else ''}"


# ------------------------------------------------------------------------------------------- device


@dataclass(frozen=True)
class Device:
    """One accelerator (or the CPU): visible ``memory`` in bytes (what a plan must fit), dense ``flops``
    per second in the training dtype, memory ``bandwidth`` in bytes per second (None where unknown) and,
    for a CPU, the RAM ``available`` now (other processes hold the rest for a while)."""

    name: str
    memory: int
    kind: str = "cuda"
    flops: float | None = None
    bandwidth: float | None = None
    available: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


def _gpu(name: str, gib: float, tflops: float, tbps: float) -> Device:
    return Device(name, int(gib * GiB), "cuda", tflops * 1e12, tbps * 1e12)


DEVICES: dict[str, Device] = {
    # visible memory as torch reports total_memory; dense bf16 peak (no sparsity); HBM/GDDR bandwidth
    "h100-80gb": _gpu("NVIDIA H100 80GB (SXM)", 79.2, 989.0, 3.35),
    "h100-pcie": _gpu("NVIDIA H100 PCIe 80GB", 79.2, 756.0, 2.0),
    "h200": _gpu("NVIDIA H200 141GB", 139.8, 989.0, 4.8),
    "a100-80gb": _gpu("NVIDIA A100 80GB", 79.2, 312.0, 2.0),
    "a100-40gb": _gpu("NVIDIA A100 40GB", 39.4, 312.0, 1.55),
    "l40s": _gpu("NVIDIA L40S 48GB", 44.4, 362.0, 0.86),
    "a10g": _gpu("NVIDIA A10G 24GB", 22.0, 125.0, 0.6),
    "l4": _gpu("NVIDIA L4 24GB", 22.0, 121.0, 0.3),
}
"""Devices a plan can be made for without being on them (``vpo plan --device NAME``)."""


def cpu_flops() -> float:
    """FLOP/s of this CPU at torch's current thread count: the best of three fp32 512 x 512 matmul
    rounds (about 0.1 s)."""
    import time

    import torch

    a = torch.randn(512, 512)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ a
        best = min(best, time.perf_counter() - t0)
    return 4 * 2 * 512**3 / best


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's cgroup memory controller (v2 or v1), None where unlimited."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                return int(limit), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
    return None, None


def ram() -> tuple[int, int]:
    """(total, available now) RAM for this process: MemTotal and MemAvailable, capped by a cgroup limit."""
    import psutil

    vm = psutil.virtual_memory()
    total, avail = int(vm.total), int(vm.available)
    limit, usage = _cgroup_memory()
    if limit is not None:
        total, avail = min(total, limit), min(avail, max(0, limit - (usage or 0)))
    return total, avail


def known_gpu(name: str, memory: int) -> Device | None:
    """The :data:`DEVICES` entry of a GPU as CUDA names it (e.g. ``NVIDIA H100 80GB HBM3``), or None."""
    n = name.upper()
    for marker, key in (("H100 PCIE", "h100-pcie"), ("H100", "h100-80gb"), ("H200", "h200"), ("L40S", "l40s"),
                        ("A10G", "a10g"), ("L4", "l4")):
        if marker in n:
            return DEVICES[key]
    if "A100" in n:
        return DEVICES["a100-80gb" if memory > 50 * GiB else "a100-40gb"]
    return None


def device_by_name(name: str) -> Device:
    """A :data:`DEVICES` entry; an unknown name lists the known ones."""
    key = name.lower().strip()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)} (or give its memory in GiB)")
    return DEVICES[key]


# ----------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TrainSettings:
    """The trainer settings a plan reads, under TRL's ``GRPOConfig`` names, plus the longest prompt
    in tokens and the dtype the weights are loaded in. No defaults of its own: a plan is of the
    settings it is given (:meth:`from_trl` takes them from a mapping, e.g. ``vars()`` of a built
    config or a pipeline's resolved settings)."""

    per_device_train_batch_size: int
    num_generations: int
    max_completion_length: int
    max_prompt_length: int
    gradient_accumulation_steps: int
    generation_batch_size: int | None
    steps_per_generation: int | None
    num_iterations: int
    gradient_checkpointing: bool
    bf16: bool
    fp16: bool
    param_dtype: str
    use_vllm: bool
    vllm_mode: str
    vllm_gpu_memory_utilization: float
    vllm_enable_sleep_mode: bool
    beta: float
    optim: str
    ds3_gather_for_generation: bool
    cast_lm_head_to_fp32: bool

    FIELDS = ("per_device_train_batch_size", "num_generations", "max_completion_length", "gradient_accumulation_steps",
              "generation_batch_size", "steps_per_generation", "num_iterations", "gradient_checkpointing", "bf16",
              "fp16", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "beta",
              "optim", "ds3_gather_for_generation", "cast_lm_head_to_fp32")

    @classmethod
    def from_trl(cls, kwargs: Mapping[str, Any], *, max_prompt_length: int, param_dtype: str) -> TrainSettings:
        """From GRPOConfig keyword arguments (or ``vars()`` of a built config) holding every name in
        :attr:`FIELDS` (a ValueError names the ones missing)."""
        missing = [k for k in cls.FIELDS if k not in kwargs]
        missing += [k for k in ("per_device_train_batch_size", "num_generations", "max_completion_length")
                    if k in kwargs and kwargs[k] is None]
        if missing:
            raise ValueError(f"trainer settings lack {', '.join(missing)}")
        values = {k: kwargs[k] for k in cls.FIELDS}
        values["bf16"], values["fp16"] = bool(values["bf16"]), bool(values["fp16"])  # TRL's None: not set
        optim = values["optim"]
        if not isinstance(optim, str):  # an OptimizerNames enum
            values["optim"] = str(getattr(optim, "value", optim))
        if param_dtype not in DTYPE_BYTES:
            raise ValueError(f"parameter dtype must be one of {', '.join(DTYPE_BYTES)}, got {param_dtype!r}")
        return cls(max_prompt_length=int(max_prompt_length), param_dtype=param_dtype, **values)

    def batch(self, world_size: int) -> Batch:
        """TRL's batch of these settings on ``world_size`` processes (:func:`vpo.trl_batch.trl_batch`).
        A built GRPOConfig holds both round settings, consistently: its generation batch counts."""
        return trl_batch(per_device_train_batch_size=self.per_device_train_batch_size,
                         num_generations=self.num_generations, world_size=world_size,
                         gradient_accumulation_steps=self.gradient_accumulation_steps,
                         generation_batch_size=self.generation_batch_size,
                         steps_per_generation=None if self.generation_batch_size is not None
                         else self.steps_per_generation, num_iterations=self.num_iterations)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes of activations: 2 under bf16/fp16 autocast or with 16-bit weights, else 4."""
        return 2 if (self.bf16 or self.fp16 or self.param_bytes == 2) else 4

    @property
    def sequence_length(self) -> int:
        return self.max_prompt_length + self.max_completion_length



def scale_shape(model: ModelShape, *, layers: int | None = None, hidden: int | None = None) -> ModelShape:
    """``model`` with fewer layers and/or a smaller hidden size (intermediate size and heads scaled
    with it, head size kept where it divides): the same architecture at a size a CPU can run."""
    out = model
    if layers is not None:
        out = replace(out, num_layers=int(layers))
    if hidden is not None:
        ratio = hidden / model.hidden_size
        heads = max(1, round(model.num_heads * ratio))
        while hidden % heads:
            heads -= 1
        group = max(1, model.num_heads // model.num_kv_heads)
        kv = max(1, heads // group)
        while heads % kv:
            kv -= 1
        out = replace(out, hidden_size=int(hidden), intermediate_size=max(8, round(model.intermediate_size * ratio)),
                      num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads)
    return out


def shape_config(model: ModelShape) -> dict[str, Any]:
    """The ``config.json`` keys :meth:`ModelShape.from_config` reads, for building the architecture."""
    return {"model_type": model.model_type, "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
            "intermediate_size": model.intermediate_size, "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
            "head_dim": model.head_dim, "tie_word_embeddings": model.tie_word_embeddings,
            **({"max_position_embeddings": model.max_position_embeddings} if model.max_position_embeddings else {})}
