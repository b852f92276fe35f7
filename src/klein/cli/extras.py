"""Optional extras a command needs: a clear exit-2 message naming the pip extra when one is missing."""

import importlib.util

from klein.errors import InputError


def require(module: str, extra: str, what: str) -> None:
    """Refuse `what` (a flag) unless `module` can be imported: `pip install 'klein[extra]'`."""
    if importlib.util.find_spec(module) is None:
        raise InputError(f"{what} needs {module}, which is not installed: pip install 'klein[{extra}]'")
