"""``vpo flow | ui | serve``: the Prefect commands of the ``vpo`` CLI.

They join ``vpo`` through the ``vpo.commands`` entry point group (``pyproject.toml``), so the pipeline
layer never imports Prefect or ``flows``; importing this module imports neither Prefect nor DVC
(handlers do, when they run).

* ``vpo flow``: the retrain flow against ``PREFECT_API_URL``, else Prefect's temporary server;
  ``--arms-on DEPLOYMENT`` trains each arm run as a flow run of that ``train-arm`` deployment on its
  work pool (:mod:`flows.arm`).
* ``vpo ui``: a local Prefect server (UI and API), the flow against it, its address printed.
* ``vpo serve``: the flow served as a cron deployment from this process, one run at a time (later
  ones queued) as ``prefect.yaml``'s deployments; against ``PREFECT_API_URL`` (it must answer), else
  against a local server this command starts and stops (Prefect's temporary server cannot schedule).

SIGTERM, SIGHUP and Ctrl-C stop what the command started -- stage process groups, the local or the
temporary Prefect server -- then it prints one line and exits 143 / 129 / 130 (no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["register"]

Handler = Callable[[argparse.Namespace], int]


def register(sub: Any, add_common_options: Callable[[argparse.ArgumentParser], None]) -> dict[str, Handler]:
    """Add ``flow``, ``ui`` and ``serve`` to the ``vpo`` sub-command parser; return their handlers."""
    p = sub.add_parser("flow", help="run the Prefect retrain flow (against PREFECT_API_URL, else a temporary server)")
    add_common_options(p)
    p.add_argument("--arms-on", default=None, metavar="DEPLOYMENT",
                   help="work-pool mode: train each arm run as a flow run of this train-arm deployment "
                        "(e.g. train-arm/train-arm-process); needs DVC stages and storage.dvc_remote")
    p = sub.add_parser("ui", help="start a local Prefect server and run the flow against it")
    add_common_options(p)
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--keep", action="store_true", help="keep the server running after the flow")
    p = sub.add_parser("serve", help="serve the retrain flow as a cron deployment (one run at a time)")
    add_common_options(p)
    p.add_argument("--cron", default="0 3 * * *", help="cron schedule (UTC)")
    p.add_argument("--name", default="nightly", help="deployment name")
    p.add_argument("--port", type=int, default=4200,
                   help="port of the local Prefect server started when PREFECT_API_URL is not set")
    return {"flow": _flow, "ui": _ui, "serve": _serve}


def _stop_temporary_servers() -> None:
    """Stop the temporary API server Prefect starts in this process when no PREFECT_API_URL is set (it
    would otherwise outlive a signal: atexit handlers do not run on SIGTERM's default action). Its
    module is only looked at when Prefect imported it: importing the server app takes seconds."""
    from vpo.pipeline.engine.processes import stopping

    module = sys.modules.get("prefect.server.api.server")
    instances = getattr(getattr(module, "SubprocessASGIServer", None), "_instances", {})
    servers = [s for s in list(instances.values()) if getattr(s, "server_process", None) is not None]
    if servers:
        from prefect.logging.handlers import APILogWorker

        with contextlib.suppress(Exception):  # what the flow logged last reaches the server before it stops
            APILogWorker.drain_all(timeout=2 if stopping() else 5)
    for server in servers:
        with contextlib.suppress(Exception):  # best effort while stopping
            server.stop()


def _guarded(args: argparse.Namespace, body: Callable[[], int], stopped: Callable[[], str]) -> int:
    """Run ``body`` with SIGTERM/SIGHUP/Ctrl-C stopping every process it started (``stopped()`` says
    what that was, and what was left running because this command did not start it): one line, exit
    128 + signal, no traceback."""
    from vpo.pipeline.cli import resume_hint
    from vpo.pipeline.engine.processes import describe, exit_code, stop_on_signals

    try:
        with stop_on_signals():
            return body()
    except KeyboardInterrupt as exc:
        _stop_temporary_servers()
        hint = f"; {resume_hint(None)}" if args.cmd != "serve" else ""
        print(f"[vpo] {describe(exc)}; {stopped()}{hint}", file=sys.stderr, flush=True)
        return exit_code(exc)
    finally:
        _stop_temporary_servers()


def _flow(args: argparse.Namespace) -> int:
    from vpo.pipeline.cli import load_config, parse_overrides

    cfg = load_config(args)
    overrides = parse_overrides(args.set)

    def body() -> int:
        from flows import retrain as rt
        from flows.tasks import console_without_stage_tracebacks

        with console_without_stage_tracebacks():
            state = rt.retrain(pipeline=cfg.name, quick=cfg.quick, config=args.config, overrides=overrides,
                               arms_on=args.arms_on, return_state=True)
        return 1 if state.is_failed() else 0

    def stopped() -> str:
        api = os.environ.get("PREFECT_API_URL")
        return (f"the running stages were stopped (the Prefect server at {api} is not this command's: left running)"
                if api else "the running stages and Prefect's temporary server were stopped")

    return _guarded(args, body, stopped)


def _ui(args: argparse.Namespace) -> int:
    from vpo.pipeline.cli import load_config, parse_overrides

    cfg = load_config(args)
    overrides = parse_overrides(args.set)
    servers: list[Any] = []

    def body() -> int:
        from flows.server import LocalServer, prefect_home, run_with_local_server
        from flows.tasks import console_without_stage_tracebacks

        servers.append(LocalServer(prefect_home(args.config), args.port))
        with console_without_stage_tracebacks():
            run_with_local_server(pipeline=cfg.name, quick=cfg.quick, config=args.config, port=args.port,
                                  keep=args.keep, overrides=overrides, server=servers[0])
        return 0

    def stopped() -> str:
        if servers and servers[0].started_here:
            return "the local Prefect server and the running stage were stopped"
        return "the running stage was stopped" + (f"; {servers[0].fate()}" if servers else "")

    return _guarded(args, body, stopped)


def _serve(args: argparse.Namespace) -> int:
    from vpo.pipeline.cli import load_config, parse_overrides

    cfg = load_config(args)
    overrides = parse_overrides(args.set)
    api = os.environ.get("PREFECT_API_URL")
    servers: list[Any] = []

    def body() -> int:
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

        from flows import retrain as rt
        from flows.server import LocalServer, healthy, prefect_home

        def serve() -> None:
            rt.serve(pipeline=cfg.name, quick=cfg.quick, config=args.config, cron=args.cron, name=args.name,
                     overrides=overrides)

        what = (f"deployment retrain/{args.name} of {cfg.variant} (cron {args.cron!r}, UTC; one run at a time, "
                "later ones queued)")
        if api:
            if not healthy(api):
                from vpo.pipeline.engine.console import command

                print(f"error: PREFECT_API_URL={api} does not answer (GET {api}/health failed); start that "
                      f"server, or unset PREFECT_API_URL and `{command(*sys.argv[1:])}` starts a local one",
                      file=sys.stderr)
                return 2
            print(f"[vpo] serving {what} against {api}; scheduled runs execute in this process; Ctrl-C stops "
                  "(the schedule is paused until it is served again)", flush=True)
            serve()
            return 0
        home = prefect_home(args.config)
        server = LocalServer(home, args.port)
        servers.append(server)
        server.start()
        try:
            both = "Ctrl-C stops both" if server.started_here else "Ctrl-C stops serving (not that server)"
            print(f"[vpo] serving {what} against a local Prefect server, UI at {server.url} (PREFECT_HOME={home}); "
                  f"scheduled runs execute in this process; {both}", flush=True)
            with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_HOME: str(home)}):
                serve()
        finally:
            server.stop()
        return 0

    def stopped() -> str:
        runs = "the served deployment's runs were cancelled and its schedule paused"
        if servers:
            return f"{runs}; {servers[0].fate()}"
        return f"{runs}; the Prefect server at {api} is not this command's: left running" if api else runs

    return _guarded(args, body, stopped)
