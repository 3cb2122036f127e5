"""The ``vpo`` command: the main job, single stages (what dvc.yaml calls), the Prefect UI and cron.

    vpo run [--pipeline P] [--quick] [--set K=V]    every stage in this process, final tables printed
    vpo stage NAME [--pipeline P] [--quick] [--arm A [--seed S]] [--force]
    vpo stage NAME --variant V [--params params.yaml]   the settings of a generated params.yaml (dvc.yaml)
    vpo flow | ui | serve [--pipeline P] [--quick] [--set K=V]   the Prefect retrain flow (flows/cli.py)
    vpo dvc [--check] [--add V] [--remove V]        regenerate (or check) dvc.yaml and params.yaml
    vpo registry list|show|best|fetch|promote|verify|migrate   registered models (DVC artifacts, GTO stages)
    vpo pipelines                                   the pipelines in pipelines.yaml
    vpo plan [--pipeline P] [--quick] [--device D | --memory GIB]   memory and step-time plan per arm

A stage runs only when its output does not answer the current settings, code and inputs (it says
why); ``--force`` runs it anyway. Exit codes: 0 done; 2 bad input (config, data, reward, checkpoint,
full disk: one ``error:`` line naming the file/row/key and what to do -- a config file that is not
UTF-8 or a disk full before the first stage included); 3 the run folder is locked by another run (see :mod:`vpo.pipeline.engine.locking`); 130 Ctrl-C, 143 SIGTERM (every process the command
started is stopped first, one line says how to resume); other codes are crashes.

Commands of other layers join through the ``vpo.commands`` entry point group: each entry is a
function ``register(subparsers, add_common_options)`` that adds its sub-commands and returns a
handler per command name. The Prefect commands (``flow``, ``ui``, ``serve``) come from
:mod:`flows.cli` that way, so this module never imports Prefect or ``flows``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["COMMAND_GROUP", "add_common_options", "load_config", "main", "parse_overrides", "resume_hint"]

COMMAND_GROUP = "vpo.commands"
"""The entry point group through which other layers add ``vpo`` sub-commands."""

Handler = Callable[[argparse.Namespace], int]

_ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "False",
    "TOKENIZERS_PARALLELISM": "false",
}


def add_common_options(p: argparse.ArgumentParser) -> None:
    """The options every pipeline command takes (pipeline, config, preset, overrides, variant)."""
    p.add_argument("--pipeline", "-p", default=None, help="pipeline name in pipelines.yaml (default: its `default`)")
    p.add_argument("--config", default="pipelines.yaml", help="path of pipelines.yaml")
    p.add_argument("--quick", action="store_true", help="apply the pipeline's `quick:` preset (tests, smoke runs)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set trainer.max_steps=10 (value parsed as YAML)")
    p.add_argument("--variant", default=None,
                   help="load this variant (e.g. route-quick) from the generated params file instead")
    p.add_argument("--params", default=None, help="the generated params file (default: params.yaml beside --config)")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings into a mapping (values parsed as YAML, as in pipelines.yaml: ``1e-4`` is a
    number); exit 2 on a malformed one."""
    import yaml

    from vpo.pipeline.config import load_yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            _fail(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = load_yaml(value)
        except yaml.YAMLError as exc:
            _fail(f"--set {key.strip()}: value {value!r} is not valid YAML ({exc})")
    return out


def _fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def load_config(args: argparse.Namespace) -> Any:
    """The pipeline config the common options name; exit 2 with one ``error:`` line when it is bad."""
    return _load(args)


def _load(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from vpo.pipeline.config import ConfigError, load_pipeline
    from vpo.pipeline.dvc.params import PARAMS_FILE, load_variant

    overrides = parse_overrides(args.set)
    try:
        if args.variant:
            if args.pipeline or args.quick:
                _fail("--variant names a pipeline and preset already; drop --pipeline/--quick")
            params = args.params or str(Path(args.config).expanduser().parent / PARAMS_FILE)
            return load_variant(args.variant, params, config_path=args.config, overrides=overrides)
        return load_pipeline(args.pipeline, args.config, quick=args.quick, overrides=overrides)
    except ConfigError as exc:
        _fail(str(exc))


def _registered_commands(sub: Any) -> dict[str, Handler]:
    """Sub-commands other installed layers add through the :data:`COMMAND_GROUP` entry points."""
    from importlib.metadata import entry_points

    handlers: dict[str, Handler] = {}
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        register = ep.load()
        handlers.update(register(sub, add_common_options))
    return handlers


def _parser() -> argparse.ArgumentParser:
    """The ``vpo`` argument parser (every command, those of other layers included)."""
    return _parser_and_handlers()[0]


def _parser_and_handlers() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    from vpo.pipeline.steps import STAGES

    handlers: dict[str, Handler] = {}
    ap = argparse.ArgumentParser(prog="vpo", description="Vector Policy Optimization pipeline")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run every stage of a pipeline (the main job); independent stages "
                                       "run side by side (execution.max_parallel)")
    add_common_options(p_run)
    p_run.add_argument("--no-search", action="store_true",
                       help="skip the search stage (it runs when the pipeline has an enabled `search:`)")
    p_run.add_argument("--force", action="store_true", help="run every stage even when its output is up to date")
    stage_help = "\n".join(f"  {s.name:<9} {s.summary}" for s in STAGES)
    p_stage = sub.add_parser("stage", help="run one stage (what dvc.yaml calls)",
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             description="Run one stage if its output is not up to date.\n\nstages:\n" + stage_help)
    p_stage.add_argument("name", choices=[s.name for s in STAGES], metavar="NAME", help="the stage (see above)")
    add_common_options(p_stage)
    p_stage.add_argument("--arm", default=None, help="train: only this arm; search: only this arm's search")
    p_stage.add_argument("--seed", type=int, default=None, help="train: only this seed")
    p_stage.add_argument("--force", action="store_true", help="run even when the output is up to date")
    handlers.update(_registered_commands(sub))
    p_dvc = sub.add_parser("dvc", help="regenerate dvc.yaml and params.yaml from pipelines.yaml")
    p_dvc.add_argument("--config", default="pipelines.yaml")
    p_dvc.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
    p_dvc.add_argument("--add", action="append", default=[], metavar="VARIANT",
                       help="declare this variant in dvc.yaml too (route: the full main job)")
    p_dvc.add_argument("--remove", action="append", default=[], metavar="VARIANT",
                       help="stop declaring this variant in dvc.yaml")
    p_reg = sub.add_parser("registry", help="registered models: list, show, best, fetch, promote, verify, migrate",
                           add_help=False)
    p_reg.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("pipelines", help="list pipelines").add_argument("--config", default="pipelines.yaml")
    p_plan = sub.add_parser("plan", help="per-device memory and step time of each arm; exit 2 when one does not fit")
    add_common_options(p_plan)
    p_plan.add_argument("--device", default=None, help="plan for this card (h100-80gb, a100-80gb, l4, ...; "
                        "default: this machine's GPU, else its RAM)")
    p_plan.add_argument("--memory", type=float, default=None, metavar="GIB", help="device memory in GiB")
    p_plan.add_argument("--tflops", type=float, default=None, help="device dense TFLOP/s for the step time")
    p_plan.add_argument("--processes", type=int, default=None, help="world size (default: the accelerate config's)")
    p_plan.add_argument("--arm", default=None, help="only this arm")
    p_plan.add_argument("--json", action="store_true",
                        help="print one JSON object: each arm's plan, the evaluation phase's and the pre-flight")
    return ap, handlers


def _print_tables(cfg: Any, ran_search: bool) -> None:
    """The run's result tables, once, after the last stage (the stages write them to the log only)."""
    from vpo.pipeline.config.layout import RunLayout

    layout = RunLayout.of(cfg)
    print("\n" + layout.eval_table.read_text())
    if ran_search and layout.search_table.is_file():
        print(layout.search_table.read_text())
        print(f"search plot: {layout.search_plot}")
    print(f"plot: {layout.eval_plot}")


def _log_path(args: argparse.Namespace, cfg: Any) -> Any:
    """The command's full log file in the run folder (none in processes `accelerate launch` started:
    their output reaches the parent's console and log)."""
    import time

    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.processes import CHILD_ENV

    if os.environ.get(CHILD_ENV):
        return None
    command = "run" if args.cmd == "run" else "-".join(
        ["stage", args.name, *([args.arm] if args.arm else []), *([f"s{args.seed}"] if args.seed is not None else [])])
    return RunLayout.of(cfg).log_file(command, time.strftime("%Y%m%d-%H%M%S"))


def resume_hint(argv: Sequence[str] | None) -> str:
    """``run `bin/vpo run --quick` again to resume (...)``: the command as it runs from here."""
    from vpo.pipeline.engine.console import command

    words = list(sys.argv[1:] if argv is None else argv)
    return (f"run `{command(*words)}` again to resume (finished stages are kept, training resumes "
            "from its last checkpoint)")


def _closing_line() -> None:
    from vpo.pipeline.engine import console

    path = console.log_file()
    if path is None:
        return
    n = console.warning_count()
    console.log(f"full log: {console.shown_path(path)}" + (f" ({n} library warning{'s' if n != 1 else ''} in it)" if n else ""))


def _stage(args: argparse.Namespace, cfg: Any) -> int:
    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.locking import pipeline_lock
    from vpo.pipeline.engine.processes import CHILD_ENV
    from vpo.pipeline.runner import run_step
    from vpo.pipeline.steps import steps_of

    steps = steps_of(cfg, [args.name])
    if args.name == "search" and args.arm is not None and args.seed is None:
        return _search_shard(cfg, args.arm)
    if args.arm is not None or args.seed is not None:
        if args.name != "train":
            _fail("--arm/--seed select a run of the train stage (or --arm one arm of the search stage) only")
        steps = [s for s in steps if (args.arm is None or s.run.arm.name == args.arm)
                 and (args.seed is None or s.run.seed == args.seed)]
        if not steps:
            _fail(f"no enabled arm {args.arm!r} with seed {args.seed} in pipeline {cfg.name!r}; "
                  f"arms: {', '.join(a.name for a in cfg.enabled_arms)}")
    layout = RunLayout.of(cfg)
    if os.environ.get(CHILD_ENV) and args.name == "train":  # a process started by `accelerate launch`
        from vpo.pipeline.engine.context import StageContext
        from vpo.pipeline.stages.train import leave_process_group, train

        for step in steps:
            train(StageContext(cfg, layout, "train", step.run))
        leave_process_group()
        return 0
    if args.name == "train" and not os.environ.get(CHILD_ENV):
        from vpo.pipeline.engine.nodes import node_role

        role = node_role(cfg)
        if role is not None and not role.is_main:  # node 0 holds the lock, checks staleness and records the run
            from vpo.pipeline.engine.context import StageContext
            from vpo.pipeline.engine.preflight import check_hardware
            from vpo.pipeline.runner import fingerprint

            check_hardware(cfg)
            for step in steps:
                step.stage.call(StageContext(cfg, layout, "train", step.run, fingerprint(cfg, step, layout)))
            return 0
    # one arm run trains beside other arm runs (shared run lock); anything else runs alone
    arm = steps[0].run.rid if args.name == "train" and len(steps) == 1 else None
    with pipeline_lock(layout.root, cfg.variant, arm=arm):
        for step in steps:
            run_step(cfg, step, layout=layout, force=args.force)
    return 0


def _search_shard(cfg: Any, arm: str) -> int:
    """``vpo stage search --arm A``: one arm's search into the stage's checkpoints, beside the others
    (``vpo stage search`` starts these itself when arms can search at once, then puts them together)."""
    import time

    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.console import quiet_libraries, stage_done
    from vpo.pipeline.engine.context import StageContext
    from vpo.pipeline.engine.locking import pipeline_lock
    from vpo.pipeline.stages.search import search_shard

    layout = RunLayout.of(cfg)
    t0 = time.time()
    quiet_libraries()
    with pipeline_lock(layout.root, cfg.variant, arm=f"search-{arm}"):
        ctx = StageContext(cfg, layout, "search", None, None, progress=False)
        search_shard(ctx, arm)
    stage_done(f"search@{arm}", time.time() - t0, ctx.notes.get("outcome"))
    return 0


def _default_storage(argv: Sequence[str]) -> tuple[str | None, tuple[str, str] | None]:
    """The default pipeline's ``storage.registry`` and DVC remote (URL, name) when a pipelines.yaml is here
    (exit 2 with the config error when it is broken); not read when ``--registry`` or ``$VPO_REGISTRY``
    names the registry (the file may be broken, or absent)."""
    from vpo.pipeline.config import ConfigError, load_pipeline

    if os.environ.get("VPO_REGISTRY") is not None or any(a == "--registry" or a.startswith("--registry=")
                                                         for a in argv):
        return None, None
    if not os.path.isfile("pipelines.yaml"):
        return None, None
    try:
        cfg = load_pipeline(None, "pipelines.yaml")
    except ConfigError as exc:  # the registry would come from this file: say what is wrong with it
        _fail(f"{exc}\n(the registry is the default pipeline's storage.registry; fix the file, or name the registry "
              "with --registry URL or VPO_REGISTRY)")
    remote = (cfg.resolve_url(cfg.storage.dvc_remote), cfg.storage.dvc_remote_name) if cfg.storage.dvc_remote else None
    return cfg.resolve_url(cfg.storage.registry), remote


_SIGNAL_CODES = (129, 130, 143)
"""Exit codes of a command stopped by SIGHUP, SIGINT or SIGTERM (128 + the signal)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``vpo`` command ``argv`` (default: this process's arguments); returns its exit code.

    Whatever escapes a command becomes one ``error:`` line and exit code 1 (the traceback goes to the
    command's log file when it has one). A command process stopped by a signal ends as soon as it said
    its line: it skips the interpreter's module teardown, which takes seconds after a model was loaded
    (exit handlers still run)."""
    as_command = argv is None
    try:
        code = _main(argv)
    except KeyboardInterrupt as exc:  # stopped before a command installed its own handling
        from vpo.pipeline.engine.processes import describe, exit_code

        print(f"[vpo] {describe(exc)}", file=sys.stderr, flush=True)
        code = exit_code(exc)
    except Exception as exc:  # noqa: BLE001 (a bug or an error class without its own line: still one line)
        code = _crashed(exc)
    if as_command and code in _SIGNAL_CODES:
        _exit_now(code)
    return code


def _crashed(exc: BaseException) -> int:
    """One line for an exception no command turned into its own error line; exit code 1."""
    import traceback

    from vpo.pipeline.engine import console
    from vpo.pipeline.engine.storage import redact

    text = (str(exc).strip().splitlines() or [""])[0]
    log = console.last_log_file()
    if log is not None:
        where = f"the traceback is in {_shown(log)}"
    elif os.environ.get("VPO_TRACEBACK"):
        traceback.print_exception(exc, file=sys.stderr)
        where = "traceback above"
    else:
        where = "VPO_TRACEBACK=1 shows the traceback"
    print(f"error: {redact(f'{type(exc).__name__}: {text}')} (unexpected: {where})", file=sys.stderr, flush=True)
    return 1


def _shown(path: Any) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _exit_now(code: int) -> None:
    """End the process with ``code`` after flushing output and running exit handlers, without the
    module teardown (a stopped stage spent 4-7 s of a loaded machine's time garbage-collecting torch)."""
    import atexit
    import logging

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        logging.shutdown()
    os._exit(code)


def _main(argv: Sequence[str] | None) -> int:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["registry"]:  # the registry's own CLI takes every argument after it (--help included)
        from vpo.pipeline.registry.cli import main as registry_main

        registry, remote = _default_storage(argv[1:])
        return registry_main(argv[1:], default_registry=registry, default_remote=remote, prog="vpo registry")
    parser, handlers = _parser_and_handlers()
    args = parser.parse_args(argv)
    if args.cmd in handlers:
        return handlers[args.cmd](args)
    if args.cmd == "pipelines":
        from vpo.pipeline.config import ConfigError, load_all

        try:
            for name, cfg in load_all(args.config).items():
                print(f"{name}: {cfg.description.strip()}")
        except ConfigError as exc:
            _fail(str(exc))
        return 0
    if args.cmd == "dvc":
        from vpo.pipeline.dvc.generate import main as dvc_main

        return dvc_main(["--config", args.config, *(["--check"] if args.check else []),
                         *[a for v in args.add for a in ("--add", v)], *[a for v in args.remove for a in ("--remove", v)]])
    cfg = load_config(args)
    if args.cmd == "plan":
        from vpo.pipeline.engine.errors import StageError
        from vpo.pipeline.memory import main as plan_main

        try:
            return plan_main(cfg, device=args.device, memory_gib=args.memory, tflops=args.tflops,
                             processes=args.processes, arm=args.arm, as_json=args.json)
        except (StageError, ValueError) as exc:
            _fail(str(exc))
    from vpo.pipeline.engine import console
    from vpo.pipeline.engine.processes import describe, exit_code, stop_on_signals

    try:
        with console.session(_log_path(args, cfg), defer_tables=args.cmd == "run"):
            try:
                with stop_on_signals():
                    code = _job(args, cfg)
            except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: the stage processes were stopped
                console.interrupted(resume_hint(argv), describe(exc))
                return exit_code(exc)
            if code == 0:
                _closing_line()
            return code
    except OSError as exc:  # the run folder's disk is full before a stage could say so (lock, log)
        from vpo.pipeline.config.layout import RunLayout
        from vpo.pipeline.engine.errors import disk_full, disk_of

        full, path = disk_full(exc)
        if not full:
            raise
        where = path or RunLayout.of(cfg).root
        _fail(f"disk full at {where} ({disk_of(where)}; {exc.strerror or exc}); free space and run "
              f"`{console.command(*argv)}` again")
    return 2  # not reached: _fail exits


def _job(args: argparse.Namespace, cfg: Any) -> int:
    """``vpo run`` / ``vpo stage``: exit 0 done, 2 bad input, 3 locked (one ``error:`` line each)."""
    from vpo.pipeline.engine.errors import EXIT_BAD_INPUT, EXIT_LOCKED, StageError
    from vpo.pipeline.engine.locking import LockBusyError
    from vpo.pipeline.engine.storage import redact
    from vpo.pipeline.registry.entries import RegistryError, StorageUnavailableError
    from vpo.pipeline.runner import StageProcessFailed
    from vpo.pipeline.validation import ValidationError
    from vpo.rewards import RewardError

    try:
        if args.cmd == "run":
            from vpo.pipeline.runner import run_all

            run_all(cfg, search=not args.no_search, force=args.force)
            _print_tables(cfg, ran_search=not args.no_search)
            return 0
        if args.cmd == "stage":
            return _stage(args, cfg)
    except LockBusyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except (StageProcessFailed, StorageUnavailableError) as exc:  # a run beside others crashed (its own output
        # says why), or the registry is unreachable (a retry may help)
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    except (StageError, RewardError, RegistryError, ValidationError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        from vpo.pipeline.config import ConfigError

        if isinstance(exc, ConfigError):  # found when a stage built the task from its parameters
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
