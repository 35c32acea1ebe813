"""The serving engine: admission, the request queue, continuous batching and the shards' gRPC
client. It knows nothing of HTTP (pytgi_router.http builds on it, never the other way round)."""
