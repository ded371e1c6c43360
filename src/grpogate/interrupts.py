"""Ctrl-C and SIGTERM: stop a run at the next safe point instead of dying in the middle of a write.

The handlers only record the request; the pipeline checks it between stages and steps, then
writes evidence with status `interrupted` (interim decision `reject`) and an interim manifest
last, and keeps the checkpoints: `--resume` continues the run, as after a SIGKILL. A second
signal stops at once (KeyboardInterrupt); the run can then be resumed from its last checkpoint.
Handlers are installed only while a run is executing, and only from the main thread (Python
delivers signals there and refuses `signal.signal` elsewhere).
"""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """A stop was requested before the run wrote (or, resumed, changed) anything."""

    def __init__(self, signal_name: str):
        super().__init__(f"interrupted by {signal_name} before anything was written")
        self.signal_name = signal_name


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def exit_code(signal_name: str) -> int:
    """The shell convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signal.Signals[signal_name])


@contextlib.contextmanager
def stop_on_signals():
    """Yield a StopRequest that SIGINT / SIGTERM set; restore the previous handlers after."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.signal_name = signal.Signals(signum).name

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
