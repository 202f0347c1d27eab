"""LoRA errors. Each is one gRPC status at the worker service (workers/server/service.py):

    AdapterError          INVALID_ARGUMENT     bad path, not PEFT, wrong base model, rank, module
    AdapterCapacityError  RESOURCE_EXHAUSTED   every slot holds a pinned adapter or one in use
    AdapterNotLoaded      NOT_FOUND            UnloadAdapter of a name this worker does not hold
    AdapterInUse          FAILED_PRECONDITION  UnloadAdapter while requests run with it
    LoraDisabled          FAILED_PRECONDITION  an adapter named on an engine without lora.enabled
"""

from __future__ import annotations

from workers.errors import DuetError


class AdapterError(DuetError, ValueError):
    """An adapter cannot be served; the message names the adapter (and the module, where one is at fault)."""


class AdapterCapacityError(DuetError):
    """No slot can be freed for another adapter."""


class AdapterNotLoaded(DuetError, KeyError):
    """No adapter of that name is loaded here."""

    def __str__(self) -> str:  # KeyError would repr() its message
        return str(self.args[0]) if self.args else ""


class AdapterInUse(DuetError):
    """The adapter has running requests."""


class LoraDisabled(DuetError):
    """The engine runs without LoRA (lora.enabled is false)."""
