"""What `klein generate` shows: a progress bar per stage (loading, then the pipeline's stage events:
encoding, compiling, each step, decoding), warnings and the timing breakdown, on stderr. The files it
writes are `klein.io.png`'s."""

import sys
from collections.abc import Mapping

from tqdm import tqdm

# Stages in the order they run; the pipeline reports all but load and write.
STAGES = ("load", "compile", "references", "prefill", "text", "denoise", "decode", "decode_tiled", "write")


LABEL_WIDTH = 19
"""Stage names are padded to this width, so that the bars' counts line up."""
ONE_SHOT = "{desc}: {bar} {n}/{total}{postfix}"
"""A stage of one unit (the loading, a stage of the pipeline), as the loading bar has always been drawn."""


class Progress:
    """The pipeline's `progress(StageEvent)` callback (`klein.pipeline.stage_events`), drawn as one tqdm bar
    per stage on stderr: shown as the stage starts, marked when XLA compiles (a first run), ended with
    the stage's time (and the compilation's)."""

    def __init__(self) -> None:
        self._bars: dict[str, tqdm] = {}

    def __call__(self, event) -> None:
        bar = self._bars.get(event.stage)
        if bar is None:
            bar = self._bars[event.stage] = _stage_bar(event)
        if event.compiling:
            bar.set_postfix_str("compiling (first run)")
        if event.finished:
            took = f"{event.seconds:.2f} s"
            if event.compile_seconds >= 0.005:
                took += f" + {event.compile_seconds:.2f} s compiling"
            bar.set_postfix_str(took, refresh=False)
            bar.update(event.total - bar.n)
            self._bars.pop(event.stage).close()
        elif event.done > bar.n:  # a step: compiling, if it was, is over
            bar.set_postfix_str("", refresh=False)
            bar.update(event.done - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def _stage_bar(event) -> tqdm:
    desc = f"{event.label:<{LABEL_WIDTH}}"
    if event.stage == "denoise":
        return tqdm(total=event.total, desc=desc, unit="step", file=sys.stderr)
    return tqdm(total=event.total, desc=desc, file=sys.stderr, bar_format=ONE_SHOT)


def loading_bar() -> tqdm:
    """Bar for loading the model."""
    return tqdm(total=1, desc=f"{'loading':<{LABEL_WIDTH}}", file=sys.stderr, bar_format=ONE_SHOT)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` replacement: one readable line, printed without breaking a progress bar."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def timing_report(timings: Mapping[str, float], total: float) -> str:
    """The seconds spent per stage, in the order the stages run, then the total."""
    names = [name for name in STAGES if name in timings] + sorted(set(timings) - set(STAGES))
    rows = [f"  {name:<11}{timings[name]:8.2f}" for name in names]
    return "\n".join(["time (s):", *rows, f"  {'total':<11}{total:8.2f}"])
