"""Task registry: a task couples problem rows, a prompt format and a vector reward.

Rows are plain dicts with at least ``id`` and ``prompt``; everything else a reward needs
(tests, grids, hazards) rides along as further columns, which TRL passes to reward code.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vpo.answers import add_instruction
from vpo.rewards import VectorReward

__all__ = ["DrawnTask", "Task", "available_tasks", "check_task_params", "get_task", "register_task", "task_parameters",
           "task_source_file"]


class Task:
    """Base task. Subclasses set ``name`` and ``reward`` and implement :meth:`load`.

    Chat models get :meth:`chat_messages` (see :mod:`vpo.chat`); a task can set
    ``system_prompt`` for a system turn, or override the method for full control.
    """

    name: str = ""
    reward: VectorReward
    system_prompt: str | None = None
    full_information_oracle: str = "best single answer with full information"
    """How result tables name :meth:`best_scalar` for tasks that have oracles."""

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


class DrawnTask(Task):
    """A task whose problems a seeded generator draws (:meth:`_draw`): the test split first, from its
    own stream, then the train split, which skips every problem sharing a :meth:`split_keys` key
    with a test problem, so nothing leaks across splits. Subclasses set ``n_train``, ``n_test`` and
    an empty ``_splits`` dict."""

    n_train: int
    n_test: int
    _splits: dict[str, list[dict[str, Any]]]

    def _draw(self, split: str, n: int, exclude: set[str]) -> list[dict[str, Any]]:
        """``n`` rows of ``split`` from its own stream, none with a key in ``exclude``."""
        raise NotImplementedError

    def split_keys(self, row: Mapping[str, Any]) -> set[str]:
        """What no train problem may share with a test problem: its prompt."""
        return {row["prompt"]}

    def load(self, split: str) -> list[dict[str, Any]]:
        """Rows of "train" or "test"; test is drawn first from its own stream, train excludes it."""
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        if "test" not in self._splits:
            self._splits["test"] = self._draw("test", self.n_test, set())
        if split == "train" and "train" not in self._splits:
            taken = {key for row in self._splits["test"] for key in self.split_keys(row)}
            self._splits["train"] = self._draw("train", self.n_train, taken)
        return [dict(r) for r in self._splits[split]]


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


def _factory(name: str) -> Callable[..., Task]:
    _import_builtin()
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(sorted(_TASKS)) or 'none'}")
    return _TASKS[name]


def _callable_params(fn: Any) -> tuple[dict[str, tuple[inspect.Parameter, Any]], bool]:
    """(name -> (parameter, type hint)) of ``fn``, and whether it also takes ``**kwargs``."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError, AttributeError):  # an annotation that cannot be resolved here
        hints = {}
    params = {k: (p, hints.get(k, Any)) for k, p in sig.parameters.items()
              if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return params, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def _declared(name: str) -> tuple[dict[str, tuple[inspect.Parameter, Any]], bool]:
    """Task ``name``'s parameters with their type hints, and whether other names may still be
    accepted (a factory forwarding ``**kwargs`` where we cannot see). A ``**params`` factory whose
    return annotation is a class, and a class whose ``__init__`` forwards ``**params`` to its
    parent's, are followed down to the parameters that are really there."""
    factory = _factory(name)
    target: Any = factory if isinstance(factory, type) else None
    params, open_ = ({}, True) if target is not None else _callable_params(factory)
    if target is None and open_:
        try:
            returned = typing.get_type_hints(factory).get("return")
        except (NameError, TypeError):
            returned = None
        target = returned if isinstance(returned, type) else None
    if target is not None:
        params, open_ = {}, True
        for klass in target.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object:
                continue
            found, open_ = _callable_params(init)
            for k, v in found.items():
                params.setdefault(k, v)
            if not open_:
                break
    return params, open_


def task_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters task ``name`` accepts (a task's parameters are its schema)."""
    return {k: p for k, (p, _) in _declared(name)[0].items()}


def _strict(annotation: Any) -> Any:
    """The annotation with its scalars made strict (YAML ``true`` is not 1, ``"3"`` is not 3) and
    tuples accepting lists (YAML has no tuples)."""
    from collections import abc

    from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr

    scalars = {bool: StrictBool, int: StrictInt, float: StrictFloat, str: StrictStr}
    if annotation in scalars:
        return scalars[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_strict(a) for a in args)]  # noqa: UP007 (built from a tuple)
    if origin is tuple:
        inner = [a for a in args if a is not Ellipsis]
        item = typing.Union[tuple(_strict(a) for a in inner)] if inner else Any  # noqa: UP007
        return list[item]  # lists only: a tuple's length is the task's own check
    if origin in (list, abc.Sequence):
        return list[_strict(args[0])] if args else list[Any]
    if origin in (dict, abc.Mapping):
        return dict[_strict(args[0]), _strict(args[1])] if len(args) == 2 else dict[str, Any]
    return annotation


def check_task_params(name: str, params: Mapping[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems with ``params`` for task ``name``, as (key path, message): unknown names (with the
    known ones), missing required ones, wrong types. Values are checked by the task itself when it
    is built; this check needs no data and runs when a pipeline is loaded."""
    from pydantic import ConfigDict, PydanticUserError, ValidationError, create_model

    try:
        declared, open_ = _declared(name)
    except KeyError as exc:
        return [((), str(exc.args[0]))]
    problems: list[tuple[tuple[str | int, ...], str]] = []
    if not open_:
        problems += [((key,), f"unknown parameter of task {name!r}; parameters: {', '.join(declared)}")
                     for key in params if key not in declared]
    fields = {key: (_strict(hint), ... if p.default is inspect.Parameter.empty else p.default)
              for key, (p, hint) in declared.items()}
    try:
        model = create_model(f"{name}_params", __config__=ConfigDict(arbitrary_types_allowed=True,
                                                                     allow_inf_nan=False), **fields)
    except (TypeError, ValueError, AttributeError, PydanticUserError):  # hints pydantic cannot express
        return problems
    try:
        model.model_validate({k: v for k, v in params.items() if k in declared})
    except ValidationError as exc:
        by_key: dict[str | int, list[str]] = {}
        for err in exc.errors():  # a union reports one error per branch: one line per parameter
            msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Input should be ")
            if err["type"] == "missing":
                msg = "required parameter is missing"
            by_key.setdefault(err["loc"][0], [])
            if msg not in by_key[err["loc"][0]]:
                by_key[err["loc"][0]].append(msg)
        for key, msgs in by_key.items():
            got = params.get(str(key))
            text = " or ".join(msgs)
            if text != "required parameter is missing":
                text = f"expected {text}, got {got!r} ({type(got).__name__})"
            problems.append(((key,), text))
    return problems


def task_source_file(name: str) -> Path | None:
    """The file that defines task ``name`` (its code is part of what a stage's output depends on)."""
    module = sys.modules.get(getattr(_factory(name), "__module__", ""))
    path = getattr(module, "__file__", None)
    return Path(path) if path else None
