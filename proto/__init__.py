"""The wire: kvguard.v1 event and finding messages (generated from proto/kvguard/v1/*.proto)
and their JSON Lines capture form. `pb` is the generated module of events.proto."""

from kvguard.proto.kvguard.v1 import events_pb2 as pb

__all__ = ["pb"]
