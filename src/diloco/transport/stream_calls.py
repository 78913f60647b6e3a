"""The Syncer service (`diloco.v1`) with the frame streams' own (de)serializers: data frames go out as
the wire bytes `frames.data_frame` made and come in as views of the bytes gRPC received (`parse_frame`),
instead of passing through a protobuf message on each side (two copies of every byte fewer each way).
The bytes on the wire are protobuf's own, so a peer built on the generated stub talks to these and back.
"""

from __future__ import annotations

from typing import Any

import grpc

from diloco.transport.frames import parse_frame, serialize_frame
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

SERVICE = "diloco.v1.Syncer"
METHODS: dict[str, tuple[str, Any, Any]] = {
    "Join": ("unary_unary", pb.JoinRequest, pb.JoinReply),
    "Init": ("stream_unary", pb.Frame, pb.InitReply),
    "Pull": ("unary_stream", pb.PullRequest, pb.Frame),
    "Push": ("stream_unary", pb.Frame, pb.PushReply),
    "Updates": ("unary_stream", pb.UpdatesRequest, pb.Frame),
    "Heartbeat": ("unary_unary", pb.HeartbeatRequest, pb.HeartbeatReply),
    "Leave": ("unary_unary", pb.LeaveRequest, pb.LeaveReply),
    "Status": ("unary_unary", pb.StatusRequest, pb.StatusReply),
}
"""Every method of the service: its cardinality, request and reply types."""


def _serializer(message_type: Any) -> Any:
    return serialize_frame if message_type is pb.Frame else message_type.SerializeToString


def _deserializer(message_type: Any) -> Any:
    return parse_frame if message_type is pb.Frame else message_type.FromString


def syncer_stub(channel: grpc.Channel) -> pb_grpc.SyncerStub:
    """The generated stub, its frame streams (de)serialized without a protobuf copy."""
    stub = pb_grpc.SyncerStub(channel)
    for name, (kind, request, reply) in METHODS.items():
        setattr(stub, name, getattr(channel, kind)(f"/{SERVICE}/{name}", request_serializer=_serializer(request),
                                                   response_deserializer=_deserializer(reply)))
    return stub


def add_syncer_to_server(servicer: pb_grpc.SyncerServicer, server: grpc.Server) -> None:
    """Serve `servicer`'s methods, as the generated `add_SyncerServicer_to_server` does, with the frame
    streams' own (de)serializers."""
    handlers = {name: getattr(grpc, f"{kind}_rpc_method_handler")(
        getattr(servicer, name), request_deserializer=_deserializer(request), response_serializer=_serializer(reply))
        for name, (kind, request, reply) in METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
