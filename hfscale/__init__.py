"""hfscale: scale configs, planning, pre-flight checks, compression and edge export for HF models."""

__version__ = "0.1.0"

from .errors import ConfigError, HfscaleError  # noqa: E402

__all__ = ["ConfigError", "HfscaleError", "__version__"]
