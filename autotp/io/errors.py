"""The errors of autotp's file I/O: each message names the file or tensor and the numbers."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and the numbers."""


class FormatError(CheckpointError):
    """A file that is not valid safetensors."""
