"""The CLI's one JSON form of a kvguard message (`kvguard fleet -o json`, `kvguard audit ...
-o json`): the protobuf JSON mapping with the proto field names, every field a reader may ask
for present, and 64-bit integers as JSON numbers.

Invariant: a field without presence (a plain scalar, a list, a map) is written even at its
default (false, 0, "", [], {}), so that `jq .connected` reads false, never null; a field with
presence (a message, a oneof member, an `optional` scalar) is written only when set, so that
what was never said stays absent. Integers are numbers (the event contract allows them), not
the strings json_format writes for 64-bit ones; bytes are base64, enums their names.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

if TYPE_CHECKING:  # the C (upb) implementation's descriptors, as a message of it hands them out
    from google._upb._message import FieldDescriptor as UpbFieldDescriptor


def message_json_dict(message: Message) -> dict[str, Any]:
    """`message` as a dict ready for a JSON encoder (see the module's invariant)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            entry = fd.message_type.fields_by_name["value"]
            # keys sorted: a map's order is the parser's, and the same message must print the same
            out[fd.name] = {key: _value(entry, value[key]) for key in sorted(value)}
        elif fd.is_repeated:
            out[fd.name] = [_value(fd, v) for v in value]
        elif fd.has_presence:
            if message.HasField(fd.name):
                out[fd.name] = _value(fd, value)
        else:
            out[fd.name] = _value(fd, value)
    return out


def _value(fd: FieldDescriptor | UpbFieldDescriptor, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return message_json_dict(value)
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    if fd.type == FieldDescriptor.TYPE_ENUM and fd.enum_type is not None:
        named = fd.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    return value
