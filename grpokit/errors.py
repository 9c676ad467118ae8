"""User-facing error types shared across the package (a leaf: imports nothing of grpokit)."""


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""
