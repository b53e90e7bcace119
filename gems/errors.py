"""The two kinds of failure a user sees, and how the CLI reports them.

``ConfigError`` is bad input: a key, the value given and what would work. The
CLI prints it as one line and exits 2 before anything is submitted or
written. ``RunError`` is a run that failed after it started (exit 1), with the
rank and the reason; ``Cancelled`` one that a signal ended (exit 128 + signal).
"""
from __future__ import annotations

from typing import Any


class ConfigError(Exception):
    """Bad input: exit status 2, one line naming the key, the value and what would work."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={_show(value)}: expected {expected}")


class RunError(Exception):
    """A run that failed after it started: exit status 1."""


class Cancelled(RunError):
    """The launcher was asked to stop (SIGINT, SIGTERM, SIGHUP): exit status 128 + the signal's number.
    ``detail`` says what became of the ranks or Slurm jobs."""

    def __init__(self, signum: int, detail: str = "") -> None:
        import signal

        self.signum, self.detail = signum, detail
        super().__init__(f"cancelled by {signal.Signals(signum).name}")


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) and (value == "" or " " in value) else str(value)
    return text if len(text) <= 120 else text[:117] + "..."
