"""The pipeline's error type and exit codes: what ``vpo`` prints as one ``error:`` line."""

from __future__ import annotations

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_LOCKED", "StageError"]

EXIT_BAD_INPUT = 2
"""Bad input (config, data, reward, checkpoint, disk full): retrying cannot help; the message says what to do."""

EXIT_LOCKED = 3
"""The run folder is locked by another run."""


class StageError(RuntimeError):
    """A stage cannot run (missing or corrupt upstream output, bad input, full disk); the message names
    the file or setting and what to do."""

EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, as a shell reports it)."""
