"""The console (vpo.pipeline.engine.console): what a person reads while a pipeline runs, and the log file that
keeps the rest; Ctrl-C during `vpo run` is one line saying how to resume."""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from vpo.pipeline.engine import console

ROOT = Path(__file__).resolve().parents[1]
VPO = Path(sys.executable).with_name("vpo")


def test_stage_lines_bars_and_numbers_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a terminal a bar prints its state as plain lines (at most every interval, and once at
    the end) with the numbers set on it; stage lines are one each."""
    out = io.StringIO()
    monkeypatch.setattr(console, "_out", lambda: out)
    monkeypatch.setattr(console, "PLAIN_BAR_INTERVAL_S", 0.0)
    console.stage_started("train@vpo-s0", "not built yet")
    with console.progress("train@vpo-s0", 3) as bar:
        for step in (1, 2, 3):
            bar.numbers({"reward": 0.25 * step, "parse": 0.9, "loss": None})
            bar.update(to=step)
    console.stage_done("train@vpo-s0", 2.4, "3 steps")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[vpo] train@vpo-s0: not built yet; running"
    assert lines[-1] == "[vpo] train@vpo-s0: done in 2 s (3 steps)"
    bar_lines = [ln for ln in lines if ln.startswith("train@vpo-s0: ")]
    assert bar_lines[-1].startswith("train@vpo-s0: 3/3 step 100%") and "reward 0.750  parse 90%" in bar_lines[-1]
    assert "loss" not in bar_lines[-1]  # a number without a value is not shown
    assert 1 <= len(bar_lines) <= 3
    assert console.current_stage() is None


def test_session_sends_library_output_to_the_file_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a session: [vpo] lines and prints reach the console and the file; library logging and
    Python warnings reach the file only (and are counted); deferred tables reach the file only."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    path = tmp_path / "logs" / "x-run.log"
    with console.session(path, defer_tables=True):
        console.log("data: done in 1 s")
        print("a plain print")
        logging.getLogger("transformers.trainer").warning("There were missing keys: ['lm_head.weight']")
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # pytest's own filters would record it instead
            warnings.warn("some FutureWarning", FutureWarning, stacklevel=1)
        console.table("| arm | best@1 |")
        console.detail("train@vpo-s0 step 1: {'loss': 0.1}")
        assert console.warning_count() == 2
    shown = out.getvalue()
    assert "[vpo] data: done in 1 s" in shown and "a plain print" in shown
    for hidden in ("missing keys", "FutureWarning", "| arm |", "step 1:"):
        assert hidden not in shown, hidden
    text = path.read_text()
    for kept in ("[vpo] data: done in 1 s", "a plain print", "missing keys", "some FutureWarning", "| arm |",
                 "train@vpo-s0 step 1:"):
        assert kept in text, kept
    assert sys.stdout is out and console.log_file() is None  # everything restored


def test_harmless_missing_keys_on_resume_are_silenced_only_while_the_tie_holds(tmp_path: Path) -> None:
    """The Trainer's warning about `lm_head.weight` missing from a checkpoint is dropped when the head
    is tied to the input embedding (loading the embedding restores it) and kept once the tie is broken."""
    import torch
    from transformers import AutoModelForCausalLM

    from vpo.pipeline.stages.train import HarmlessMissingKeysFilter
    from vpo.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", "abc", seed=0, hidden_size=16,
                                                                  intermediate_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=1))
    filt = HarmlessMissingKeysFilter(model)
    message = "There were missing keys in the checkpoint model loaded: ['lm_head.weight']."

    def passes(msg: str) -> bool:
        return filt.filter(logging.LogRecord("transformers.trainer", logging.WARNING, "", 0, msg, None, None))

    assert not passes(message)
    assert passes("There were missing keys in the checkpoint model loaded: ['model.norm.weight'].")
    assert passes("something else")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    assert passes(message)


@pytest.mark.slow
@pytest.mark.integration
def test_ctrl_c_is_one_line_saying_how_to_resume(tmp_path: Path) -> None:
    """SIGINT while `vpo run --quick` trains its base: exit 130, one `interrupted` line naming the stage
    and the command to run again (runnable as printed), no traceback; the log file is there."""
    shutil.copy(ROOT / "pipelines.yaml", tmp_path / "pipelines.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # SIGINT back to its default in the child: a shell that starts the test suite in the background
    # ignores SIGINT for it, and a Python started with SIGINT ignored never raises KeyboardInterrupt
    default_sigint = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", default_sigint, str(VPO), "run", "--quick", "--config",
                             "pipelines.yaml"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # wait until the base stage (SFT, ~30 s) has started
        seen.append(line)
        if line.startswith("[vpo] base:") or time.monotonic() > deadline:
            break
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err[-3000:]
    line = [ln for ln in out.splitlines() if "interrupted" in ln]
    # the command as it runs from that folder without an activated virtualenv: this installation's vpo
    expected = (f"[vpo] interrupted during base; run `{VPO} run --quick --config pipelines.yaml` again to resume "
                "(finished stages are kept, training resumes from its last checkpoint)")
    assert line == [expected], out[-2000:]
    assert list((tmp_path / "runs" / "route-quick" / "logs").glob("*-run.log"))


def test_printed_commands_run_without_an_activated_virtualenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a checkout the command is `bin/vpo ...` (the launcher finds the project's Python); elsewhere
    it is this installation's own `vpo` script by absolute path; words are shell-quoted."""
    monkeypatch.chdir(tmp_path)
    assert console.command("run", "--set", "a=b c") == f"{VPO} run --set 'a=b c'"
    monkeypatch.chdir(ROOT)
    assert console.command("run", "--quick") == "bin/vpo run --quick"
    out = subprocess.run(["sh", "-c", console.command("pipelines") + " >/dev/null && echo ok"], cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_printed_while_a_bar_is_drawn_starts_on_its_own_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal a console line (own or relayed) printed while a bar is drawn in place clears the
    bar first and draws it again below, so the line never starts where the bar ends."""
    out = _Terminal()
    monkeypatch.setattr(console, "_out", lambda: out)
    with console.progress("search", 8, unit="runs") as bar:
        bar.update(2)
        console.log("search: 4 arms, 2 at once")
        console.relay("[vpo] search@vpo: done in 2 s", console=True)
        bar.update(2)
    text = out.getvalue()
    for line in ("[vpo] search: 4 arms, 2 at once\n", "[vpo] search@vpo: done in 2 s\n"):
        before = text[: text.index(line)]
        assert before.endswith(("\r", "\n")), repr(text[:400])  # cleared: column 0
    assert text.rstrip().splitlines()[-1].split("\r")[-1].startswith("search:  50%|"), repr(text[-300:])


def test_one_seed_has_no_spread_in_the_tables() -> None:
    """A table of one run per arm shows the number, not "± 0.000"; several runs show their spread."""
    assert console.mean_std({"mean": 0.41234, "std": 0.0}, 1) == "0.412"
    assert console.mean_std({"mean": 0.41234, "std": 0.0191}, 3) == "0.412 ± 0.019"


def test_session_records_library_loggers_another_setup_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``logging.config.dictConfig`` elsewhere in the process (DVC's, a server's) disables the loggers
    that existed then; inside a session their records still reach the file, and the loggers are left
    as they were after it."""
    lib = logging.getLogger("transformers.modeling_utils")
    monkeypatch.setattr(lib, "disabled", True)  # what dictConfig(disable_existing_loggers=True) does
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    path = tmp_path / "x-run.log"
    with console.session(path):
        lib.warning("weights not used: ['lm_head.bias']")
        assert console.warning_count() == 1
    assert "weights not used" in path.read_text()
    assert lib.disabled


def test_session_records_python_warnings_when_another_capture_is_active(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``logging.captureWarnings(True)`` called earlier in the process and never undone (a library's
    setup) makes a second call a no-op; a session's file still gets the Python warnings, and the
    previous ``warnings.showwarning`` is back after it."""
    monkeypatch.setattr(logging, "_warnings_showwarning", warnings.showwarning)  # as if captured before
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    before = warnings.showwarning
    path = tmp_path / "x-run.log"
    with console.session(path):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a DeprecationWarning of some library", DeprecationWarning, stacklevel=1)
        assert console.warning_count() == 1
    assert "a DeprecationWarning of some library" in path.read_text()
    assert warnings.showwarning is before
