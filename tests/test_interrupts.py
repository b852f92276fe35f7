"""Ctrl+C stops `klein generate` and `klein batch` within seconds at any stage, exit 130, no file left behind;
`klein serve` stops cleanly, exit 0, or at once past its grace, exit 130. Each run is a subprocess sent SIGINT once its stderr shows the stage.

Each run costs a JAX start-up and the demo's load (~5-10 s on two cores), so these are slow tests.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from klein.cli import interrupts
from tests.support import serve_process

pytestmark = pytest.mark.slow

PROMPT = ["--prompt", "a red fox"]
PROMPT_TIMEOUT = 120
"""Seconds a stage may take to show (a loaded machine compiles slowly)."""
STEPPING = r"\| +[1-9]\d*/200 "
"""The denoising bar past its first step (of 200, so that many remain)."""
LOWERED = r"Finished jaxpr to MLIR module conversion jit\({}\)"
"""JAX's log (JAX_LOG_COMPILES=1) of a program traced and lowered, `format`ted with its name: XLA's
compilation starts next, at 3072x3072 for seconds without returning to Python (3.3 s of the denoising step on
2 cores at the tests' --xla_backend_optimization_level=1), then the first step's run."""
SETTLE = 1
"""Seconds from LOWERED to well inside XLA's compilation (the denoising bar's "compiling (first run)" shows
as the tracing starts, ~0.3 s before it: 5 s from there were past the compilation, in the step's run)."""
LOG_COMPILES = {"JAX_LOG_COMPILES": "1"}
LARGE = ["--size", "3072x3072", "--max-pixels", str(3072 * 3072)]
"""An image XLA compiles and steps through for tens of seconds at a time (past klein serve's size limit)."""
STOPPED_WITHIN = interrupts.GRACE + 4
"""Seconds from Ctrl+C to the process's end: the grace, and time for the exit itself on a loaded machine."""


class Running:
    """A `klein` subprocess whose stderr is read as it comes (tqdm redraws with \\r, so by characters)."""

    def __init__(self, klein_home, *args, cwd, env=None):
        env = {**os.environ, "KLEIN_HOME": str(klein_home), "JAX_PLATFORMS": "cpu", **(env or {})}
        command = [sys.executable, "-m", "klein.cli.main", *map(str, args)]
        self.process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while chunk := self.process.stderr.read(1):
            self.stderr += chunk

    def wait_for(self, text: str) -> None:
        """Until stderr matches the regular expression `text`."""
        deadline = time.monotonic() + PROMPT_TIMEOUT
        while not re.search(text, self.stderr):
            assert self.process.poll() is None, f"ended before {text!r}:\n{self.stderr}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.stderr}"
            time.sleep(0.05)

    def interrupt(self, presses: int = 1) -> tuple[int, float]:
        """Ctrl+C `presses` times; (exit code, seconds from the last to the process's end)."""
        code, took = self.interrupt_process(self.process, presses)
        self._reader.join(timeout=5)
        return code, took

    @staticmethod
    def interrupt_process(process: subprocess.Popen, presses: int = 1) -> tuple[int, float]:
        for _ in range(presses):
            sent = time.monotonic()
            process.send_signal(signal.SIGINT)
            time.sleep(0.2 if presses > 1 else 0)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        return code, time.monotonic() - sent


def _generate(klein_home, out, *size, env=None):
    return Running(klein_home, "generate", *PROMPT, *size, "--out", out / "fox.png", cwd=out, env=env)


def _assert_stopped(run, code, took, out):
    assert code == interrupts.EXIT_INTERRUPTED, run.stderr
    assert took < STOPPED_WITHIN, f"took {took:.1f} s to stop:\n{run.stderr}"
    assert "Traceback" not in run.stderr
    assert list(out.iterdir()) == [], "nothing written, not even a temporary file"


def test_ctrl_c_while_loading(klein_home, tmp_path):
    run = _generate(klein_home, tmp_path, "--steps", "2", "--height", "64", "--width", "64")
    run.wait_for("loading")
    _assert_stopped(run, *run.interrupt(), tmp_path)


def test_ctrl_c_while_compiling_a_large_image(klein_home, tmp_path):
    """The KeyboardInterrupt alone would wait for XLA (and then for the interpreter's exit, which waits for
    the step in flight)."""
    run = _generate(klein_home, tmp_path, *LARGE, env=LOG_COMPILES)
    run.wait_for(LOWERED.format("step"))
    time.sleep(SETTLE)
    _assert_stopped(run, *run.interrupt(), tmp_path)


def test_ctrl_c_between_steps(klein_home, tmp_path):
    run = _generate(klein_home, tmp_path, "--steps", "200", "--height", "256", "--width", "256")
    run.wait_for(STEPPING)
    _assert_stopped(run, *run.interrupt(), tmp_path)


def test_second_ctrl_c_stops_at_once(klein_home, tmp_path):
    run = _generate(klein_home, tmp_path, *LARGE, env=LOG_COMPILES)
    run.wait_for(LOWERED.format("step"))
    time.sleep(SETTLE)
    code, took = run.interrupt(presses=2)
    assert code == interrupts.EXIT_INTERRUPTED, run.stderr
    assert took < interrupts.GRACE, f"took {took:.1f} s after the second Ctrl+C"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_stops_a_batch(klein_home, tmp_path):
    """Interrupted while its line compiles a large image: no PNG, no temporary file, and the results file
    whole (a resume starts from it)."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "a red fox", "height": 4096, "width": 4096}) + "\n")
    out = tmp_path / "out"
    # A batch draws no stage bars: JAX's own log of its compilations shows when the line's denoising step
    # (the first program of its 65,536 image tokens) goes to XLA.
    flags = ("--out", out, "--max-pixels", str(4096 * 4096))
    run = Running(klein_home, "batch", requests, *flags, cwd=tmp_path, env=LOG_COMPILES)
    run.wait_for(r"Compiling jit\((\w+)\).*\[1,65536,[\s\S]*" + LOWERED.format(r"\1"))
    time.sleep(SETTLE)
    code, took = run.interrupt()
    assert code == interrupts.EXIT_INTERRUPTED, run.stderr
    assert took < STOPPED_WITHIN, f"took {took:.1f} s to stop:\n{run.stderr}"
    assert not [path.name for path in out.iterdir() if path.suffix in (".png", ".tmp")]
    assert all(json.loads(line) for line in (out / "results.jsonl").read_text().splitlines())


def test_ctrl_c_stops_serve_cleanly(klein_home):
    """An idle server stopped by Ctrl+C, as its --help says: exit 0, at once."""
    process, _ = serve_process.start(klein_home)
    code, took = Running.interrupt_process(process)
    assert code == 0, serve_process.log_of(process)
    assert took < STOPPED_WITHIN
    assert "Traceback" not in serve_process.log_of(process)


def test_ctrl_c_stops_serve_while_it_compiles_ahead(klein_home):
    """Warming (compiling ahead in its worker thread, for longer than the grace): no job runs, so nothing
    is waited for: a clean stop at once, not the grace waited out."""
    grace = 20  # --shutdown-grace: well under the compiling's time
    flags = ("--warm-size", "2048x2048", "--shutdown-grace", str(grace))
    process, _ = serve_process.start(klein_home, *flags, warm=True)
    code, took = Running.interrupt_process(process)
    assert code == 0, serve_process.log_of(process)
    assert took < STOPPED_WITHIN < grace


def test_an_interrupt_python_cannot_pass_on_is_dropped_without_a_traceback(monkeypatch):
    """A Ctrl+C landing in a garbage collector's callback (jax has one) cannot be raised there: Python hands
    it to `sys.unraisablehook`, which printed its traceback; within `stoppable` it is dropped (the watch ends
    the process after the grace), and anything else still reaches the hook that was there."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_type))

    class Raises:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    with interrupts.stoppable():
        Raises(KeyboardInterrupt())
        Raises(ValueError("not an interrupt"))
    Raises(KeyboardInterrupt())
    assert seen == [ValueError, KeyboardInterrupt]
