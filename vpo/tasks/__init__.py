"""Task registry: a task couples problem rows, a prompt format and a vector reward.

Rows are plain dicts with at least ``id`` and ``prompt``; everything else a reward needs
(tests, grids, hazards) rides along as further columns, which TRL passes to reward code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vpo.answers import add_instruction
from vpo.rewards import VectorReward

__all__ = ["Task", "available_tasks", "get_task", "register_task"]


class Task:
    """Base task. Subclasses set ``name`` and ``reward`` and implement :meth:`load`.

    Chat models get :meth:`chat_messages` (see :mod:`vpo.chat`); a task can set
    ``system_prompt`` for a system turn, or override the method for full control.
    """

    name: str = ""
    reward: VectorReward
    system_prompt: str | None = None

    def load(self, split: str) -> list[dict[str, Any]]:
        """Return the rows of ``split`` ("train" or "test")."""
        raise NotImplementedError

    def format_prompt(self, row: Mapping[str, Any], m: int) -> Any:
        """The model-facing prompt for ``row`` asking for m answers (m=1: a single answer)."""
        return add_instruction(row["prompt"], m, self.reward.answer_tag)

    def chat_messages(self, row: Mapping[str, Any], m: int) -> list[dict[str, Any]]:
        """The conversation for chat models: ``system_prompt`` (if set) then a user turn holding
        :meth:`format_prompt` (the m-answer instruction inside it)."""
        from vpo.chat import default_messages

        return default_messages(self, row, m)


_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator registering a task factory under ``name``."""

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _TASKS:
            raise ValueError(f"task {name!r} is already registered")
        _TASKS[name] = factory
        return factory

    return deco


def _import_builtin() -> None:
    import importlib

    for mod in ("vpo.tasks.route", "vpo.tasks.code", "vpo.tasks.phrase"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:  # a task module not written yet is simply not offered
            if exc.name != mod:
                raise


def available_tasks() -> list[str]:
    _import_builtin()
    return sorted(_TASKS)


def get_task(name: str, **params: Any) -> Task:
    """Build the task registered as ``name`` with ``params``; unknown names list the known ones."""
    _import_builtin()
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(sorted(_TASKS)) or 'none'}")
    return _TASKS[name](**params)
