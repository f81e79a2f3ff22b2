"""lakeshard: pool idle office laptops into one LLM."""

__version__ = "0.1.0"  # what agents advertise; tests/integration/test_doctor.py checks it equals the package's


def version() -> str:
    """This copy's version, from its package metadata (pyproject's version)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("lakeshard")
    except importlib.metadata.PackageNotFoundError:
        return f"{__version__} (not installed)"
