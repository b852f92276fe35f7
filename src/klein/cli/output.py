"""What `klein generate` shows: progress bars, warnings and the timing breakdown, on stderr. The files
it writes are `klein.io.png`'s."""

import sys
from collections.abc import Mapping

from tqdm import tqdm

# Stages in the order they run; the pipeline reports all but load and write.
STAGES = ("load", "compile", "references", "prefill", "text", "denoise", "decode", "decode_tiled", "write")


class Progress:
    """The pipeline's `progress(stage, done, total)` callback, drawn as one tqdm bar per stage on stderr."""

    def __init__(self) -> None:
        self._bars: dict[str, tqdm] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self._bars:
            self._bars[stage] = tqdm(total=total, desc=f"{stage:<9}", unit="step", file=sys.stderr)
        bar = self._bars[stage]
        bar.update(done - bar.n)
        if done >= total:
            self._bars.pop(stage).close()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def loading_bar(total: int) -> tqdm:
    """Bar for reading the reference images and then the model (`total` items in all)."""
    return tqdm(
        total=total, desc=f"{'loading':<9}", file=sys.stderr, bar_format="{desc}: {bar} {n}/{total}{postfix}"
    )


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` replacement: one readable line, printed without breaking a progress bar."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def timing_report(timings: Mapping[str, float], total: float) -> str:
    """The seconds spent per stage, in the order the stages run, then the total."""
    names = [name for name in STAGES if name in timings] + sorted(set(timings) - set(STAGES))
    rows = [f"  {name:<11}{timings[name]:8.2f}" for name in names]
    return "\n".join(["time (s):", *rows, f"  {'total':<11}{total:8.2f}"])
