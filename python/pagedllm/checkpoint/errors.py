"""Errors raised while reading a checkpoint; every message names the file or field at fault."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed or describes an unsupported model."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint folder, or a file it must contain, does not exist."""
