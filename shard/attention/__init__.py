"""Paged attention: the metadata of a flat batch and the backends that attend over it."""

from pytgi_shard.attention.backend import BACKENDS, AttentionBackend, get_backend
from pytgi_shard.attention.metadata import AttentionMetadata

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_backend"]
