"""The forms of an adapter's update on a weight W float[out, in], in PyTorch's layout: a low-rank product (LoRA,
LoCon), a Hadamard product of two (LoHa) and a Kronecker product (LoKr); DoRA is any of them with a magnitude
per output row (docs/loras.md, docs/design/lora.md). Pure numpy: each form's rows (for a fused module split
over klein's kernels), its dense difference (what a merge adds) and, where the form is one, its low-rank
factors (what an adapter slot holds).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np


@dataclasses.dataclass(frozen=True)
class LowRank:
    """`up @ down`: up float32[out, r], down float32[r, in]."""

    name: ClassVar[str] = "LoRA"
    """The kind as users name it."""

    down: np.ndarray
    up: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.up.shape[0], self.down.shape[1]

    def rows(self, index: np.ndarray) -> LowRank:
        return LowRank(self.down, self.up[index])

    def delta(self) -> np.ndarray:
        return self.up @ self.down

    def low_rank(self) -> LowRank:
        return self


@dataclasses.dataclass(frozen=True)
class Hadamard:
    """`first ⊙ second`, the elementwise product of two low-rank products (LoHa)."""

    name: ClassVar[str] = "LoHa"
    """The kind as users name it."""

    first: LowRank
    second: LowRank

    @property
    def shape(self) -> tuple[int, int]:
        return self.first.shape

    def rows(self, index: np.ndarray) -> Hadamard:
        return Hadamard(self.first.rows(index), self.second.rows(index))

    def delta(self) -> np.ndarray:
        return self.first.delta() * self.second.delta()

    def low_rank(self) -> LowRank:
        """The same matrix as one low-rank product of rank r1 * r2: (U1 V1) ⊙ (U2 V2) = (U1 • U2)(V1 • V2),
        with • the row-wise Kronecker product of the ups and the column-wise one of the downs."""
        (d1, u1), (d2, u2) = (self.first.down, self.first.up), (self.second.down, self.second.up)
        down = (d1[:, None, :] * d2[None, :, :]).reshape(-1, d1.shape[1])
        up = (u1[:, :, None] * u2[:, None, :]).reshape(u1.shape[0], -1)
        return LowRank(down, up)


@dataclasses.dataclass(frozen=True)
class Kronecker:
    """`kron(w1, w2)`: w1 float32[a, b], w2 float32[c, d]; out = a * c, in = b * d (LoKr)."""

    name: ClassVar[str] = "LoKr"
    """The kind as users name it."""

    w1: np.ndarray
    w2: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        (a, b), (c, d) = self.w1.shape, self.w2.shape
        return a * c, b * d

    def rows(self, index: np.ndarray) -> Kronecker:
        """Rows `index` of the product, itself a Kronecker product: whole rows of w1 (row p of w1 gives rows
        p * c .. p * c + c - 1), or some rows of w2 under one row of w1; else a `ValueError` saying why."""
        c = self.w2.shape[0]
        index = np.asarray(index)
        if len(index) % c == 0:
            grid = index.reshape(-1, c)
            if (grid == grid[:, :1] + np.arange(c)).all() and (grid[:, 0] % c == 0).all():
                return Kronecker(self.w1[grid[:, 0] // c], self.w2)
        if len(np.unique(index // c)) == 1:
            p = index[0] // c
            return Kronecker(self.w1[p : p + 1], self.w2[index % c])
        raise ValueError(
            f"its Kronecker factors ({self.w1.shape[0]} x {c} rows) do not split at the rows of one of the "
            f"fused module's parts ({len(index)} rows)"
        )

    def row_terms(self, index: np.ndarray) -> list[Kronecker]:
        """Rows `index` of the product as a sum of Kronecker products: `rows` where that is one, else one
        term per run of g rows of w2 (g the largest divisor of c in whose aligned runs `index` goes), its
        first factor holding the row of w1 over each run of `index` that reads those rows of w2 and zeros
        elsewhere. A fused module's part (a third of q/k/v, a half of the final adaLN) takes at most c / g
        = 3 terms."""
        try:
            return [self.rows(index)]
        except ValueError:
            pass
        c = self.w2.shape[0]
        index = np.asarray(index)
        g = next(g for g in range(c, 0, -1) if c % g == 0 and _in_runs(index, g))
        starts = index[::g]
        run = (starts % c) // g
        return [
            Kronecker(
                np.where((run == q)[:, None], self.w1[starts // c], 0).astype(self.w1.dtype),
                self.w2[q * g : (q + 1) * g],
            )
            for q in np.unique(run)
        ]

    def delta(self) -> np.ndarray:
        return np.kron(self.w1, self.w2)


def _in_runs(index: np.ndarray, g: int) -> bool:
    """Whether `index` is runs of g consecutive numbers, each starting at a multiple of g."""
    if len(index) % g:
        return False
    grid = index.reshape(-1, g)
    return bool((grid == grid[:, :1] + np.arange(g)).all() and (grid[:, 0] % g == 0).all())


Form = LowRank | Hadamard | Kronecker
