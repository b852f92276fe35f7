"""The Python API's progress bar: one tqdm bar per `pipe(...)` call on stderr, as diffusers draws, counting
the stages and steps the pipeline's stage events tell (`klein.pipeline.stage_events`). A caller that
passes its own `progress` callback (the CLI, the server) gets no bar.
"""

import sys

from tqdm.auto import tqdm

from klein.pipeline.stage_events import StageEvent

UNCOUNTED = "{desc}{elapsed}"
"""The bar before the denoising steps (the count) are known: "encoding prompt: 00:01"."""


class CallBar:
    """A `progress(StageEvent)` callback, drawn as one bar: a stage or a step is one unit."""

    def __init__(self, options: dict):
        options = {"file": sys.stderr, "unit": "stage", **options}
        self._format = options.pop("bar_format", None)
        # The step count is known once steps run: until then the bar says what runs and for how long
        # (tqdm's own form with no total reads "0stage [00:00, ?stage/s]").
        self._bar = tqdm(total=None, desc="starting: ", bar_format=self._format or UNCOUNTED, **options)

    def __call__(self, event: StageEvent) -> None:
        if event.stage == "denoise" and self._bar.total is None:
            self._bar.total = self._bar.n + event.total + 1  # the steps, then the decoding
            self._bar.bar_format = self._format
        if event.is_step or (event.finished and event.stage != "denoise"):
            self._bar.update(1)
        elif not event.finished:
            self._bar.set_description(f"{event.label} (compiling)" if event.compiling else event.label)

    def close(self) -> None:
        self._bar.close()
