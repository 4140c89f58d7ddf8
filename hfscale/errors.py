"""User-facing errors: the CLI prints them as one line and exits 2, never a traceback."""


class HfscaleError(Exception):
    """Bad input from the user. The message names the fix."""


class ConfigError(HfscaleError, ValueError):
    """An impossible or conflicting configuration."""
