"""klein's own version, as installed."""


def version() -> str:
    """klein's installed version ("unknown" when run from a source tree that was never installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("klein")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
