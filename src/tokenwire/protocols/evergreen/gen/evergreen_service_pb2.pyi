from . import evergreen_pb2 as _evergreen_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionMessage(_message.Message):
    __slots__ = ("node_fragments", "actions")
    NODE_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    node_fragments: _containers.RepeatedCompositeFieldContainer[_evergreen_pb2.NodeFragment]
    actions: _containers.RepeatedCompositeFieldContainer[_evergreen_pb2.Action]
    def __init__(self, node_fragments: _Optional[_Iterable[_Union[_evergreen_pb2.NodeFragment, _Mapping]]] = ..., actions: _Optional[_Iterable[_Union[_evergreen_pb2.Action, _Mapping]]] = ...) -> None: ...
