"""klein's own folder for generated files: the demo checkpoint and the compilation cache."""

import os
from pathlib import Path


def klein_home() -> Path:
    """`$KLEIN_HOME`, default `~/.cache/klein`."""
    return Path(os.environ.get("KLEIN_HOME", Path.home() / ".cache" / "klein"))
