"""Ctrl+C that stops a command within seconds, whatever it is doing: inside XLA, Python may not run a signal's
handler for minutes, so a watcher thread woken by the C-level handler exits 130 once the grace is over, or
at a second Ctrl+C (docs/design/serving.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from klein.io import durable

EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command Ctrl+C stopped."""
GRACE = 3.0
"""Seconds the main thread has, after a Ctrl+C, to unwind by itself."""


@contextlib.contextmanager
def stoppable(
    grace: float = GRACE,
    stopping: str | Callable[[], str] = "stopping",
    signals: tuple[int, ...] = (signal.SIGINT,),
) -> Iterator[None]:
    """Within: a Ctrl+C prints `stopping` (a callable: what it returns then) and is a KeyboardInterrupt as
    usual, and the process exits 130 `grace` seconds later if it has not by then, or at once on a second
    Ctrl+C. `signals`: those watched so (each whose Python handler runs: `klein serve` adds SIGTERM, exit
    143). Leaving ends the watch, unless by that KeyboardInterrupt: then it goes on, so that an exit stuck in
    XLA ends in time too."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)  # the C handler must never block on a full pipe
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    ended = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(read, grace, stopping, ended, signals), name="klein-interrupts", daemon=True
    )
    watcher.start()
    interrupted, hook = False, sys.unraisablehook
    sys.unraisablehook = functools.partial(_quiet_interrupt, hook)
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True  # the watch goes on until the process exits
        raise
    finally:
        if not interrupted:
            sys.unraisablehook = hook
            ended.set()
            signal.set_wakeup_fd(previous)
            os.close(write)  # wakes the watcher, which closes `read`


def _quiet_interrupt(hook, unraisable) -> None:
    """`sys.unraisablehook` within `stoppable`: a Ctrl+C's KeyboardInterrupt raised where Python cannot pass
    it on (a garbage collector's callback, jax's among them) is dropped without its traceback; the watch
    still ends the process once the grace is over. Anything else goes to `hook`."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        return
    hook(unraisable)


def _watch(read: int, grace: float, stopping, ended: threading.Event, watched: tuple[int, ...]) -> None:
    deadline, code = None, EXIT_INTERRUPTED
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read], [], [], timeout)  # the GIL is free meanwhile
        if not ready and not ended.is_set():
            exit_now(code)  # the grace is over
        signals = os.read(read, 64) if ready else b""
        if ended.is_set() or not signals:
            os.close(read)
            return
        for number in signals:
            if number not in watched:
                continue
            if deadline is not None:
                exit_now(code)  # a second signal
            deadline, code = time.monotonic() + grace, 128 + number  # as a shell reports a signal's stop
            again = " (Ctrl+C again to stop at once)" if number == signal.SIGINT else ""
            _say(f"{stopping() if callable(stopping) else stopping}{again}")


def exit_now(code: int = EXIT_INTERRUPTED) -> NoReturn:
    """Remove the temporary files of the writes under way and exit `code` without waiting for anything: not
    for the computation in flight, which the interpreter's exit would (and a second Ctrl+C meanwhile would
    end the process by the signal, not with 130)."""
    durable.remove_temporaries()
    _say("interrupted")
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()  # the paths already reported
    os._exit(code)


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"\n{line}\n")
        sys.stderr.flush()
