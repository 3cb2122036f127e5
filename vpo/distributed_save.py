"""The final save of a model trained on several processes: a full state dict gathered from shards, then a
plain Hugging Face folder written by rank 0.

Under DeepSpeed ZeRO-3 and FSDP (full or sharded state dict type) no process holds the whole model:
gathering it is a collective that every rank must enter, or rank 0 waits forever for ranks that have
returned. :func:`full_state_dict` asks the model itself how it is sharded (a DeepSpeed engine at stage 3,
FSDP-wrapped modules or FSDP2's DTensor parameters), so the same code runs under ``accelerate launch``
and under plain ``torch.distributed`` (accelerate sets up no FSDP on a CPU, where the tests run).
accelerate's ``Accelerator.get_state_dict`` does the same for an accelerator it prepared.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHARDED_KINDS", "full_state_dict", "save_from_shards", "sharding"]

SHARDED_KINDS = ("deepspeed-zero3", "fsdp")
"""What :func:`sharding` calls a model whose parameters are spread over the ranks."""


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return isinstance(t, DTensor)


def sharding(model: Any) -> str:
    """``deepspeed-zero3``, ``fsdp`` (FSDP1 wrapper or FSDP2 DTensor parameters) or ``none`` (every rank
    holds the whole model: a single process, DDP, DeepSpeed ZeRO-0/1/2)."""
    partitioned = getattr(model, "zero_optimization_partition_weights", None)
    if callable(partitioned) and partitioned():
        return "deepspeed-zero3"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return "fsdp"
    if any(_is_dtensor(p) for p in model.parameters()):
        return "fsdp"
    return "none"


def full_state_dict(model: Any) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, on the CPU, on rank 0 (None on the other ranks) for a sharded model:
    a COLLECTIVE, every rank must call it. For a model every rank holds whole, None on every rank (each
    rank can read its own ``state_dict()``; nothing is gathered)."""
    kind = sharding(model)
    if kind == "none":
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if kind == "deepspeed-zero3":
        # needs stage3_gather_16bit_weights_on_model_save: true (infra/accelerate/ds_zero3.json sets it)
        state = model._zero3_consolidated_16bit_state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return dict(state) if rank == 0 and state else None


def _unwrap(model: Any) -> Any:
    """The Hugging Face model inside DeepSpeed's engine, DDP or an FSDP1 wrapper."""
    while hasattr(model, "module") and not hasattr(model, "save_pretrained"):
        model = model.module
    return model


def save_from_shards(model: Any) -> Callable[[str | Path], None] | None:
    """COLLECTIVE for a sharded model (every rank must call it): gather the full state dict; on rank 0
    return ``save(folder)`` that writes the plain Hugging Face folder (``save_pretrained`` with that state
    dict), on other ranks and for a model every rank holds whole None (then the caller saves as usual)."""
    state = full_state_dict(model)
    if state is None:
        return None
    hf_model = _unwrap(model)

    def save(folder: str | Path) -> None:
        hf_model.save_pretrained(str(folder), state_dict=state)

    return save
