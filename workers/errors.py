"""Typed errors of the engine. Each is a ValueError where bad input is the cause, so callers that
only know the standard library still catch it; the serving layer maps them to gRPC status codes."""

from __future__ import annotations


class DuetError(Exception):
    """Base of every error Duet raises on purpose."""


class ConfigError(DuetError, ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


class ModelNotFoundError(DuetError, ValueError):
    """The model name or path does not resolve to a checkpoint."""


class CheckpointError(DuetError, ValueError):
    """A checkpoint directory exists but is incomplete or corrupt."""


class InvalidRequestError(DuetError, ValueError):
    """A request field is invalid. ``field`` names it (e.g. 'top_p'), the message gives the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
