"""What a step cache decided during a generation (`GenerationOutput.step_cache`): for every step that ran,
each block group's choice (reuse or compute) and relative residual difference, per image and per pass
(the prompts', and under separate CFG the negatives'), in cache-dit's terms."""

from __future__ import annotations

import dataclasses

import numpy as np

from klein.models.step_cache import DYNAMIC

GROUPS = ("double", "single")
BRANCHES = ("cond", "uncond")


@dataclasses.dataclass(frozen=True)
class CacheReport:
    """The decisions, per step, pass, block group and row, with cache-dit's views of them."""

    cached: np.ndarray
    """bool[steps, passes, 2 groups, rows]: the step reused the group's cached residual."""
    diffs: np.ndarray
    """float32[steps, passes, 2, rows]: the relative residual difference the group measured."""
    phases: np.ndarray
    """int32[steps]: what each step's index alone decided (`klein.models.step_cache`)."""
    images: int
    """The batch's images (rows beyond them under one doubled pass are their negatives; beyond both, padding)."""
    guided: bool
    """Whether negative passes ran (classifier-free guidance)."""

    @property
    def branches(self) -> tuple[str, ...]:
        """The passes each image ran: its prompt's, and under guidance its negative's."""
        return BRANCHES if self.guided else BRANCHES[:1]

    def _column(self, group: str, branch: str, image: int) -> tuple[np.ndarray, np.ndarray]:
        g = GROUPS.index(group)
        b = BRANCHES.index(branch)
        if self.cached.shape[1] == 2:
            return self.cached[:, b, g, image], self.diffs[:, b, g, image]
        rows = self.cached.shape[3]
        if branch not in self.branches:
            raise ValueError("no negative pass ran: the request had no guidance")
        row = b * (rows // 2) + image
        return self.cached[:, 0, g, row], self.diffs[:, 0, g, row]

    def cached_steps(self, group: str, branch: str = "cond", image: int = 0) -> list[int]:
        """The steps at which `group` ("double" or "single") reused its residual for `image`'s prompt
        ("cond") or negative ("uncond") pass: cache-dit's cached_steps / cfg_cached_steps."""
        return [int(s) for s in np.flatnonzero(self._column(group, branch, image)[0])]

    def residual_diffs(self, group: str, branch: str = "cond", image: int = 0) -> dict[int, float]:
        """The relative residual difference measured at each step the threshold decided (step -> diff)."""
        cached, diffs = self._column(group, branch, image)
        return {int(s): float(diffs[s]) for s in np.flatnonzero(self.phases == DYNAMIC)}

    def computed(self, group: str, image: int = 0) -> int:
        """Passes of `group`'s middle blocks run for `image` over the request (prompt and negative)."""
        return sum(len(self.phases) - len(self.cached_steps(group, b, image)) for b in self.branches)

    def describe(self) -> str:
        """One line: how many passes of each group computed, of how many."""
        passes = len(self.phases) * len(self.branches)
        return "step cache: " + ", ".join(
            f"{g} blocks computed {self.computed(g)} of {passes} passes" for g in GROUPS
        )
