"""The worker endpoints that SGLang's router (sglang-router / sgl-model-gateway) calls on each
worker it balances, so that pytgi replicas can sit behind it: `/server_info` and `/model_info`
(and their `/get_` forms, which it falls back to) for the worker's model and limits,
`/get_load` for its load, `/flush_cache` for its prefix cache. Field names are SGLang's; each
value is pytgi's own (the router's served limits, the shards' KV geometry)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError
from pytgi_router.http.http_io import error_response, json_response
from pytgi_router.http.state import AppState


class FlushRefusedError(InferError):
    """SGLang answers 400 when requests are pending: a live sequence's KV cannot be dropped."""

    status_code = 400
    error_type = "validation"
    metric_label = "validation"

    def __init__(self) -> None:
        super().__init__("Cache not flushed: requests are in flight; retry when idle")


class WorkerRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    def routes(self) -> list[Route]:
        return [
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/get_load", self.load, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
        ]

    def model_json(self) -> dict[str, Any]:
        """What routers key workers by (served_model_name, model_path) and how they tell a
        generation model from an embedding one (is_generation)."""
        s, st = self.state.settings, self.state
        return {
            "model_path": s.served_model_id,
            "served_model_name": st.model_id,
            "tokenizer_path": s.tokenizer_name,
            "is_generation": True,
            "model_type": st.infer.info.model_type,
            "architectures": list(st.architectures),
            "preferred_sampling_params": None,
            "weight_version": st.model_sha,
            "has_image_understanding": st.images.vision is not None,
            "has_audio_understanding": False,
        }

    async def model_info(self, request: Request) -> Response:
        return json_response(self.model_json())

    async def server_info(self, request: Request) -> Response:
        """SGLang's server arguments that a router reads, from the values pytgi serves with."""
        s, info = self.state.settings, self.state.infer.info
        return json_response({
            **self.model_json(),
            "tp_size": info.world_size,
            "dp_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "max_total_num_tokens": info.max_batch_total_tokens,
            "max_prefill_tokens": info.max_batch_prefill_tokens,
            "context_length": info.max_total_tokens,
            "max_running_requests": s.max_batch_size or s.max_concurrent_requests,
            "max_batch_size": s.max_batch_size,
            "page_size": info.block_size,
            "version": self.state.version,
        })

    async def load(self, request: Request) -> Response:
        """One entry per data-parallel rank (pytgi has one): requests and KV tokens in use."""
        infer = self.state.infer
        used_blocks = infer.kv_blocks_total - infer.kv_blocks_free
        return json_response([{
            "dp_rank": 0,
            "num_reqs": infer.running_count + infer.queue_size,
            "num_waiting_reqs": infer.queue_size,
            "num_tokens": used_blocks * infer.info.block_size,
        }])

    async def flush_cache(self, request: Request) -> Response:
        """Forgets the cached prefixes (behind --api-key like every non-probe route); 400 while
        requests are in flight, as SGLang."""
        if not self.state.infer.flush_prefix_cache():
            return error_response(FlushRefusedError())
        return Response("Cache flushed.\n", media_type="text/plain")
