"""A stand-in for `trl vllm-serve` in the lifecycle tests (tests/test_vllm_server.py): a small HTTP server
answering ``GET /health/`` and nothing else. It generates nothing; it only behaves like a server the
train stage starts, waits for and stops.

``python tests/support/vllm_standin.py serve --port P [--pidfile F] [--start-after S] [--die-after S]
[--never-answer] [--exit-code N]``: serve (after S seconds), die S seconds after starting to serve,
accept connections and never answer, or exit at once with N.

``python tests/support/vllm_standin.py hold --port P --ready F``: run
:func:`vpo.pipeline.engine.vllm_server.serving` around an endless wait, under the ``vpo`` command's
signal handling, writing the server's pid to F once it is healthy (the test then sends SIGINT or SIGTERM).
"""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import sys
import threading
import time
from pathlib import Path


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 200 if self.path.rstrip("/") == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        sys.stderr.write("standin: " + (args[0] % args[1:] if args else "") + "\n")  # type: ignore[operator]


def serve(opts: argparse.Namespace) -> int:
    if opts.pidfile:
        Path(opts.pidfile).write_text(str(os.getpid()))
    if opts.exit_code is not None:
        print(f"standin: failing at start with {opts.exit_code}", flush=True)
        return int(opts.exit_code)
    time.sleep(opts.start_after)
    if opts.never_answer:  # the port is open, every request hangs
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", opts.port))
        sock.listen(16)
        held = []
        while True:
            conn, _ = sock.accept()
            held.append(conn)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", opts.port), _Health)
    if opts.die_after is not None:
        threading.Timer(opts.die_after, lambda: os._exit(7)).start()
    print(f"standin: serving on 127.0.0.1:{opts.port}", flush=True)
    server.serve_forever()
    return 0


def server_command(port: int, *extra: str) -> tuple[str, ...]:
    """The command that starts this stand-in on ``port``."""
    return (sys.executable, str(Path(__file__).resolve()), "serve", "--port", str(port), *extra)


def hold(opts: argparse.Namespace) -> int:
    from vpo.pipeline.engine.processes import exit_code, stop_on_signals
    from vpo.pipeline.engine.vllm_server import ServerSpec, serving

    spec = ServerSpec(server_command(opts.port), f"http://127.0.0.1:{opts.port}/health/", 60.0,
                      Path(opts.ready).with_suffix(".server.log"))
    try:
        with stop_on_signals(), serving(spec) as server:
            assert server.proc is not None
            Path(opts.ready).write_text(str(server.proc.pid))
            while True:
                time.sleep(0.1)
    except KeyboardInterrupt as exc:
        return exit_code(exc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "hold"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pidfile")
    ap.add_argument("--ready")
    ap.add_argument("--start-after", type=float, default=0.0)
    ap.add_argument("--die-after", type=float)
    ap.add_argument("--never-answer", action="store_true")
    ap.add_argument("--exit-code", type=int)
    opts = ap.parse_args(argv)
    return serve(opts) if opts.mode == "serve" else hold(opts)


if __name__ == "__main__":
    raise SystemExit(main())
