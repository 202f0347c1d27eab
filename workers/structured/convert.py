"""StructuredOutput <-> the protos' ``StructuredOutput`` messages (duet.v1 and duet.worker.v1 have the
same shape: a oneof ``kind`` of json_object / json_schema / regex / choice / grammar).

Example::

    spec = spec_from_proto(request.sampling.structured)   # None when the oneof is unset
    worker_msg = spec_to_proto(spec, worker_pb2.StructuredOutput)
"""

from __future__ import annotations

from typing import Any, TypeVar

from workers.errors import InvalidRequestError
from workers.structured.spec import StructuredOutput

M = TypeVar("M")


def spec_from_proto(msg: Any) -> StructuredOutput | None:
    """The spec a proto ``StructuredOutput`` carries (either package's), or None when it is unset.
    Raises InvalidRequestError naming ``structured.<kind>`` for an invalid spec."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidRequestError("structured.json_object", "must be true when set (unset it for free text)")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.choices))
    return StructuredOutput(kind, getattr(msg, kind))


def spec_to_proto(spec: StructuredOutput | None, message_type: type[M]) -> M:
    """``spec`` as a ``message_type`` (duet_pb2.StructuredOutput or worker_pb2.StructuredOutput);
    an empty message (no kind set) for None."""
    msg: Any = message_type()  # either message class: the same fields
    if spec is None:
        return msg
    if spec.kind == "json_object":
        msg.json_object = True
    elif spec.kind == "choice":
        msg.choice.choices.extend(spec.choices)
    else:
        setattr(msg, spec.kind, spec.value)
    return msg
