"""The Python API's progress bar: one tqdm bar per `pipe(...)` call on stderr, as diffusers draws.

It counts the stages of a call: the text encoding, each denoising step, the decoding (or the latents'
denormalisation, for output_type="latent").
`pipe.set_progress_bar_config(**tqdm_options)` configures it as diffusers' method does
(`disable=True` turns it off). A caller that passes its own `progress` callback (the CLI, the server)
gets no bar: it draws or reports progress itself.
"""

import sys

from tqdm.auto import tqdm


class CallBar:
    """A `Stages` listener and a `progress(stage, done, total)` callback, drawn as one bar."""

    def __init__(self, options: dict):
        options = {"file": sys.stderr, "unit": "stage", **options}
        self._bar = tqdm(total=None, desc="text", **options)  # the step count is known once steps run

    def done(self, stage: str) -> None:
        """`Stages` finished `stage`: the text and decoding stages count one each."""
        if stage == "text":
            self._bar.set_description("denoise")
            self._bar.update(1)
        elif stage.startswith("decode") or stage == "latents":
            self._bar.update(1)
            self._bar.close()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self._bar.total is None:
            self._bar.total = total + 2
        if done >= total:
            self._bar.set_description("decode")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
