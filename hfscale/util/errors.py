"""User-facing errors: the CLI prints them as one line and exits 2, never a traceback."""


class HfscaleError(Exception):
    """Bad input from the user. The message names the fix."""


class ConfigError(HfscaleError, ValueError):
    """An impossible or conflicting configuration."""


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message for a one-line error, or its type name when the message is
    empty (pyarrow on an empty file, a bare RecursionError): never an IndexError of its own."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__
