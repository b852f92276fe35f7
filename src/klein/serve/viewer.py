"""Who asks for the server's figures (/metrics, /v1/config, /v1/loras): with API keys a key sees its own
figures and the server's sums, the operator's key (`KEY operator` in the key file) every key's; without keys
everyone sees everything, as one owner does (docs/serving.md, "Security")."""

from __future__ import annotations

import dataclasses

EVERYONE = None
"""The owner of everything without keys (`klein.serve.quotas.owner` of a request without a key)."""


@dataclasses.dataclass(frozen=True)
class Viewer:
    owner: str | None = EVERYONE
    """The label of the asking key (None without keys)."""
    operator: bool = True
    """Sees every key's figures: the operator's key, or anyone without keys."""

    def sees(self, owner: str | None) -> bool:
        """Whether this viewer may see a figure of `owner`'s."""
        return self.operator or owner == self.owner


def viewer(scope) -> Viewer:
    """The viewer of a request: its API key (`klein.serve.guard` leaves it in the scope's state), if any."""
    key = scope.get("state", {}).get("api_key")
    return Viewer() if key is None else Viewer(key.label, key.operator)


ALL = Viewer()
"""What the operator (and anyone, without keys) sees: every key's figures."""
