"""What the pipeline prints, and where everything else goes.

The console gets: one line per stage start and end (``[vpo] train@vpo-s0: not built yet; running``,
``[vpo] train@vpo-s0: done in 12 s``), a few event lines (resuming, stale checkpoints deleted), one
progress bar per long step (SFT, each training run, evaluation, search) with the numbers that matter,
and the result tables once. Everything else -- library logging and warnings, the full metrics of every
training log step, model loading -- goes to the log file of a :func:`session` (in the run folder's
``logs/``), which also receives every console line. On a terminal a bar redraws in place; anywhere
else (a pipe, ``dvc repro``, the Prefect task log) it prints a plain line at most every
:data:`PLAIN_BAR_INTERVAL_S` and one when it ends, so logs stay readable.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TextIO

__all__ = ["PLAIN_BAR_INTERVAL_S", "Bar", "command", "current_stage", "detail", "format_numbers", "interrupted",
           "last_log_file", "log", "log_file", "mean_std", "progress", "quiet_libraries", "relay", "session", "shown_path",
           "stage_done", "stage_started", "table", "tool", "warning_count"]

PREFIX = "[vpo]"
PLAIN_BAR_INTERVAL_S = 10.0
"""Without a terminal, a progress bar prints a line at most this often (and when it ends)."""

_LIBRARY_LOGGERS = ("transformers", "trl", "accelerate", "datasets", "huggingface_hub", "dvclive", "torch",
                    "great_expectations", "urllib3", "filelock", "matplotlib", "py.warnings")


class _State:
    """The open session (or none): the log file, the real console stream and what is deferred."""

    def __init__(self) -> None:
        self.file: TextIO | None = None
        self.path: Path | None = None
        self.console: TextIO | None = None
        self.defer_tables = False
        self.stage: str | None = None
        self.warnings = 0
        self.bar_open = False
        self.live_bar: Any = None  # the tqdm bar drawn on the terminal now, redrawn below other lines
        self.last_path: Path | None = None


_S = _State()
_WRITE = threading.RLock()  # stage processes run side by side: their relayed lines never interleave mid-line


def _out() -> TextIO:
    return _S.console or sys.stdout


def _to_file(text: str) -> None:
    with _WRITE:
        if _S.file is not None:
            _S.file.write(text if text.endswith("\n") else text + "\n")
            _S.file.flush()


def _to_console(text: str) -> None:
    """A line on the console; a bar being drawn in place is cleared first and drawn again below it
    (the line would otherwise start where the bar ends)."""
    with _WRITE:
        out, bar = _out(), _S.live_bar
        if bar is not None:
            bar.clear()
        out.write(text if text.endswith("\n") else text + "\n")
        out.flush()
        if bar is not None:
            bar.refresh()


def log(msg: str) -> None:
    """One pipeline line on the console and in the log file (flushed, so it interleaves correctly with
    subprocess output)."""
    line = f"{PREFIX} {msg}"
    _to_console(line)
    _to_file(line)


def detail(text: str) -> None:
    """Text for the log file only (full metric dicts, library chatter); printed when no session is open
    only if ``VPO_VERBOSE`` is set."""
    if _S.file is not None:
        _to_file(text)
    elif os.environ.get("VPO_VERBOSE"):
        _to_console(text)


def table(text: str) -> None:
    """A result table: in the log file, and on the console unless the session defers tables (``vpo run``
    prints the tables of the run folder once, after the last stage)."""
    _to_file(text)
    if not _S.defer_tables:
        _to_console(text)


def interrupted(how_to_resume: str, why: str = "interrupted") -> None:
    """The one line a Ctrl-C (or SIGTERM: ``why`` "stopped by SIGTERM") prints, after ending a
    half-drawn bar."""
    _S.live_bar = None  # the bar stops where it is: the line goes below it
    if _S.bar_open:
        _to_console("")
    where = f" during {_S.stage}" if _S.stage else ""
    log(f"{why}{where}; {how_to_resume}")


def relay(line: str, *, console: bool) -> None:
    """A line another process printed (a stage running beside others): into the log file, and onto
    the console when ``console``."""
    if console:
        _to_console(line)
    _to_file(line)


def command(*words: str) -> str:
    """A ``vpo`` command line that runs as printed from the current folder, with no virtualenv
    activated: ``bin/vpo ...`` in a checkout of the project, else this installation's ``vpo`` script
    (absolute path), else ``python -m vpo.pipeline.cli ...``."""
    if Path("bin/vpo").is_file() and os.access("bin/vpo", os.X_OK):
        head = "bin/vpo"
    else:
        script = Path(sys.executable).with_name("vpo")
        head = shlex.quote(str(script)) if script.is_file() else f"{shlex.quote(sys.executable)} -m vpo.pipeline.cli"
    return " ".join([head, *(shlex.quote(w) for w in words)])


def tool(name: str, *words: str) -> str:
    """A command of a tool installed beside this interpreter (``dvc``, ``prefect``, ``gto``) that runs as
    printed from the current folder with no virtualenv activated: ``.venv/bin/dvc push`` in a checkout."""
    exe = Path(sys.executable).with_name(name)
    head = shown_path(exe) if exe.is_file() else name
    return " ".join([shlex.quote(head), *(shlex.quote(w) for w in words)])


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the current folder when it is inside it, else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def stage_started(label: str, why: str, verb: str = "running") -> None:
    """``[vpo] <label>: <why>; <verb>``: the one line a stage prints when it starts."""
    _S.stage = label
    log(f"{label}: {why}; {verb}")


def stage_done(label: str, seconds: float, outcome: str | None = None) -> None:
    """``[vpo] <label>: done in N s[ (outcome)]``: the one line a stage prints when it ends."""
    _S.stage = None
    log(f"{label}: done in {seconds:.0f} s" + (f" ({outcome})" if outcome else ""))


def current_stage() -> str | None:
    """The stage that started and has not ended (for the interrupt message)."""
    return _S.stage


def log_file() -> Path | None:
    """The open session's log file."""
    return _S.path


def last_log_file() -> Path | None:
    """The log file of the session open now, else of the last one this process opened."""
    return _S.path or _S.last_path


def warning_count() -> int:
    """Warnings and errors that libraries logged into the session's file (not shown on the console)."""
    return _S.warnings


def format_numbers(numbers: Mapping[str, float | None]) -> str:
    """``reward 0.312  E max 0.420  parse 94%  loss 0.011``: the bar's numbers, compact."""
    parts = []
    for name, value in numbers.items():
        if value is None:
            continue
        if name in ("parse", "parse rate"):
            parts.append(f"{name} {100 * value:.0f}%")
        else:
            parts.append(f"{name} {value:.3g}" if abs(value) >= 1000 else f"{name} {value:.3f}")
    return "  ".join(parts)


def mean_std(value: Mapping[str, float], runs: int) -> str:
    """``0.412 ± 0.019`` over several runs; ``0.412`` for one run, whose spread is no number at all."""
    return f"{value['mean']:.3f}" + (f" ± {value['std']:.3f}" if runs > 1 else "")


class Bar:
    """One progress bar: a redrawn tqdm bar on a terminal, plain lines elsewhere. ``update`` moves it,
    ``numbers`` sets what it shows beside the count; ``close`` prints its last state once more in
    plain mode and writes it to the log file."""

    def __init__(self, desc: str, total: int, unit: str, initial: int = 0, interactive: bool | None = None) -> None:
        self.desc, self.total, self.unit = desc, max(0, int(total)), unit
        self.n = int(initial)
        self.values: dict[str, float | None] = {}
        self.note = ""
        self.t0 = time.monotonic()
        self._last_line = 0.0
        self._closed = False
        out = _out()
        self.interactive = _isatty(out) if interactive is None else interactive
        self._tqdm = None
        if self.interactive:
            self._tqdm = _tqdm_class()(total=self.total, initial=self.n, desc=desc, unit=unit, file=out, leave=True,
                                       dynamic_ncols=True, bar_format="{desc}: {percentage:3.0f}%|{bar:20}| "
                                       "{n_fmt}/{total_fmt} [{elapsed}<{remaining}]  {numbers}")
            _S.live_bar = self._tqdm
        _S.bar_open = True

    def _postfix(self) -> str:
        text = format_numbers(self.values)
        return "  ".join(p for p in (text, self.note) if p)

    def line(self) -> str:
        """The bar's state as one plain line."""
        pct = f" {100 * self.n / self.total:3.0f}%" if self.total else ""
        post = self._postfix()
        return (f"{self.desc}: {self.n}/{self.total} {self.unit}{pct} in {time.monotonic() - self.t0:.0f} s"
                + (f"  {post}" if post else ""))

    def update(self, n: int = 1, *, to: int | None = None) -> None:
        """Advance by ``n`` (or to ``to``)."""
        new = self.n + n if to is None else int(to)
        if self._tqdm is not None:
            self._tqdm.update(new - self.n)
        self.n = new
        self._plain()

    def numbers(self, values: Mapping[str, float | None] | None = None, note: str | None = None) -> None:
        """Set the numbers (and a short note) shown beside the count."""
        if values is not None:
            self.values = dict(values)
        if note is not None:
            self.note = note
        if self._tqdm is not None:
            self._tqdm.numbers = self._postfix()
            self._tqdm.refresh()

    def _plain(self) -> None:
        if self._tqdm is not None:
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_BAR_INTERVAL_S and self.n < self.total:
            if self._last_line:  # the first interval passes silently: short steps print one line
                _to_console(self.line())
            self._last_line = now

    def close(self) -> None:
        """End the bar: its final state on the console (plain mode) and in the log file."""
        if self._closed:
            return
        self._closed = True
        _S.bar_open = False
        if self._tqdm is not None:
            if _S.live_bar is self._tqdm:
                _S.live_bar = None
            self._tqdm.close()
        else:
            _to_console(self.line())
        _to_file(self.line())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tqdm_class() -> type:
    """tqdm with a ``{numbers}`` field in its format (tqdm's own postfix adds a comma before it)."""
    from tqdm import tqdm

    class _Tqdm(tqdm):  # type: ignore[misc]
        numbers = ""

        @property
        def format_dict(self) -> dict[str, Any]:
            return {**super().format_dict, "numbers": self.numbers}

    return _Tqdm


def progress(desc: str, total: int, unit: str = "step", initial: int = 0) -> Bar:
    """A :class:`Bar` for one long step (use as a context manager or call ``close``)."""
    return Bar(desc, total, unit, initial)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _Tee(io.TextIOBase):
    """A text stream writing to the console stream and the session's log file."""

    def __init__(self, console: TextIO) -> None:
        self._console = console

    def write(self, text: str) -> int:
        self._console.write(text)
        if _S.file is not None and text:
            # carriage-return redraws (a library's own bar) keep only their last state in the file
            _S.file.write(text.rsplit("\r", 1)[-1] if "\r" in text else text)
        return len(text)

    def flush(self) -> None:
        self._console.flush()
        if _S.file is not None:
            _S.file.flush()

    def isatty(self) -> bool:
        return _isatty(self._console)

    def fileno(self) -> int:
        return self._console.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._console, "encoding", "utf-8")


class _CountingHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            _S.warnings += 1


def quiet_libraries() -> None:
    """Switch off the progress bars libraries draw for every model load and save (weights loading,
    shard writing, dataset maps); our own bars say what is going on. Called when a stage that loads
    models starts (:meth:`vpo.pipeline.steps.Stage.run`), not when a session opens: a command that
    finds every stage up to date imports no ML library for it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules or _importable("transformers"):
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.disable_default_handler()  # its warnings go to the log file through the root logger
        tlog.enable_propagation()
    if "datasets" in sys.modules or _importable("datasets"):
        import datasets

        datasets.disable_progress_bars()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _warning_to_log(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
    """``warnings.showwarning`` inside a session: the warning is a record of the ``py.warnings`` logger."""
    logging.getLogger("py.warnings").warning("%s", warnings.formatwarning(message, category, filename, lineno, line))


@contextmanager
def session(path: Path | None, *, defer_tables: bool = False) -> Iterator[Path | None]:
    """Route output for one command: console lines and bars to the terminal, everything (console lines,
    stdout/stderr, library logging, Python warnings) to ``path``. With ``defer_tables`` :func:`table`
    writes to the file only (the command prints its tables at the end). Restores streams and handlers
    on exit; ``path`` None sets up nothing."""
    if _S.file is not None or path is None:  # nested, or no file wanted: nothing to set up
        yield _S.path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed below)
    old_out, old_err = sys.stdout, sys.stderr
    _S.file, _S.path, _S.console, _S.last_path = fh, path, old_out, path
    _S.defer_tables, _S.warnings, _S.stage = defer_tables, 0, None
    root = logging.getLogger()
    old_level = root.level
    handler = logging.StreamHandler(fh)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    counter = _CountingHandler()
    root.addHandler(handler)
    root.addHandler(counter)
    root.setLevel(logging.INFO)
    saved = {}
    for name in _LIBRARY_LOGGERS:  # library records end in the file only, whatever handlers they had
        lg = logging.getLogger(name)
        saved[name] = (lg.handlers[:], lg.propagate)
        lg.handlers = [h for h in lg.handlers if not isinstance(h, logging.StreamHandler)
                       or getattr(h, "stream", None) not in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)]
        lg.propagate = True
    # a logging.config.dictConfig call elsewhere in the process (DVC's, a server's) disables every logger
    # that existed then unless told otherwise: the session's file gets library records all the same
    disabled = [lg for name, lg in logging.root.manager.loggerDict.items()
                if isinstance(lg, logging.Logger) and lg.disabled
                and (name == "py.warnings" or name.split(".")[0] in _LIBRARY_LOGGERS)]
    for lg in disabled:
        lg.disabled = False
    old_showwarning = warnings.showwarning  # Python warnings to the file (logging.captureWarnings does
    warnings.showwarning = _warning_to_log  # nothing when something else captured them before and kept them)
    sys.stdout, sys.stderr = _Tee(old_out), _Tee(old_err)
    fh.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
    try:
        yield path
    except Exception:  # the traceback goes to the file too (the console gets it from the interpreter)
        fh.write(traceback.format_exc())
        raise
    finally:
        sys.stdout, sys.stderr = old_out, old_err
        warnings.showwarning = old_showwarning
        root.removeHandler(handler)
        root.removeHandler(counter)
        root.setLevel(old_level)
        for name, (handlers, propagate) in saved.items():
            lg = logging.getLogger(name)
            lg.handlers, lg.propagate = handlers, propagate
        for lg in disabled:
            lg.disabled = True
        fh.close()
        _S.file, _S.path, _S.console = None, None, None
        _S.defer_tables = False

