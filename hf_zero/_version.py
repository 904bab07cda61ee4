"""The package version (read by the checkpoint metadata and the CLI)."""

__version__ = "0.1.0"
