"""The router ↔ shard protocol: generate.proto and its generated stubs."""

from . import generate_pb2, generate_pb2_grpc

__all__ = ["generate_pb2", "generate_pb2_grpc"]
