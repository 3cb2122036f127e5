"""TRL's batch rule, stated once: what one optimizer step and one generation round of GRPO hold.

TRL's ``GRPOConfig`` derives the generation round from ``per_device_train_batch_size``, the number of
processes and either ``generation_batch_size`` or ``steps_per_generation`` (at most one may be given;
neither: one round per optimizer step), and every round must hold whole groups of
``num_generations`` completions. :func:`trl_batch` applies that rule to plain numbers and returns a
:class:`Batch`; the pipeline's config check, the train stage's console line and the memory plan
all read it from here. Pure arithmetic: no TRL import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Batch", "trl_batch"]


@dataclass(frozen=True)
class Batch:
    """One run's batch in TRL's terms: ``per_device`` completions per device per micro-step, ``world``
    processes, ``accumulation`` micro-steps per optimizer step, ``generations`` rollouts per prompt,
    a generation round every ``steps_per_generation`` micro-steps, reused ``num_iterations`` times."""

    per_device: int
    world: int
    accumulation: int
    generations: int
    steps_per_generation: int
    num_iterations: int = 1

    @property
    def completions_per_step(self) -> int:
        """Completions one optimizer step trains on."""
        return self.per_device * self.world * self.accumulation

    @property
    def prompts_per_step(self) -> float:
        """Prompt groups one optimizer step trains on."""
        return self.completions_per_step / self.generations

    @property
    def completions_per_round(self) -> int:
        """TRL's generation_batch_size: completions generated per generation round."""
        return self.per_device * self.world * self.steps_per_generation

    @property
    def prompts_per_round(self) -> float:
        """Prompts sampled per generation round."""
        return self.completions_per_round / self.generations

    @property
    def steps_per_round(self) -> float:
        """Optimizer steps one generation round feeds."""
        return self.steps_per_generation * self.num_iterations / self.accumulation

    def record(self) -> dict[str, Any]:
        """The batch as plain data (a run's metrics.json and stage record)."""
        return {"world_size": self.world, "per_device_train_batch_size": self.per_device,
                "gradient_accumulation_steps": self.accumulation, "num_generations": self.generations,
                "steps_per_generation": self.steps_per_generation, "num_iterations": self.num_iterations,
                "completions_per_optimizer_step": self.completions_per_step,
                "prompts_per_optimizer_step": _number(self.prompts_per_step),
                "completions_per_generation_round": self.completions_per_round,
                "prompts_per_generation_round": _number(self.prompts_per_round),
                "optimizer_steps_per_generation_round": _number(self.steps_per_round)}

    def describe(self) -> str:
        """One console line: prompts and completions per optimizer step and per generation round."""
        processes = f"{self.world} process{'es' if self.world != 1 else ''}"
        return (f"{_number(self.prompts_per_step)} prompts x {self.generations} rollouts = {self.completions_per_step} "
                f"completions per optimizer step ({processes} x {self.per_device} per device x {self.accumulation} "
                f"accumulation); {_number(self.prompts_per_round)} prompts = {self.completions_per_round} completions "
                f"per generation round, for {_number(self.steps_per_round)} step(s)")


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 4)


def trl_batch(*, per_device_train_batch_size: int, num_generations: int, world_size: int = 1,
              gradient_accumulation_steps: int = 1, generation_batch_size: int | None = None,
              steps_per_generation: int | None = None, num_iterations: int = 1, where: str = "") -> Batch:
    """The :class:`Batch` TRL builds from these settings on ``world_size`` processes. A
    :class:`ValueError` (prefixed by ``where``) names the settings when TRL's rule does not hold: both
    round settings given, a generation batch that is no multiple of the processes' micro-batch, or a
    round that does not hold whole groups of ``num_generations``."""
    per_device, world, g = per_device_train_batch_size, world_size, num_generations
    prefix = f"{where}: " if where else ""
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(f"{prefix}set generation_batch_size or steps_per_generation, not both (TRL derives one "
                         "from the other)")
    if generation_batch_size is not None:
        if generation_batch_size % (per_device * world):
            raise ValueError(f"{prefix}generation_batch_size {generation_batch_size} must be a multiple of "
                             f"per_device_train_batch_size {per_device} x {world} process(es) = {per_device * world}")
        steps = generation_batch_size // (per_device * world)
    else:
        steps = steps_per_generation or gradient_accumulation_steps
    batch = Batch(per_device, world, gradient_accumulation_steps, g, steps, num_iterations)
    if batch.completions_per_round % g:
        example = per_device * g // math.gcd(per_device, g) if world == 1 else g
        raise ValueError(
            f"{prefix}a generation round of {batch.completions_per_round} completions (per_device_train_batch_size "
            f"{per_device} x {world} process(es) x steps_per_generation {steps}) does not hold whole groups of "
            f"num_generations {g}; make it a multiple of {g}, e.g. per_device_train_batch_size {example} or more "
            "processes/steps_per_generation")
    return batch
