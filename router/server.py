"""The router process's lifecycle: tokenizer, shards (connect + warmup), HTTP serving, drain.

SIGTERM/SIGINT drain, in two phases: first /health answers 503 (not ready) while every route still
admits requests, for --drain-grace-seconds, so that load balancers and Kubernetes (whose endpoint
removal races the signal) stop sending here before anything is refused; then new requests answer
503 too, in-flight ones finish (up to --graceful-termination-timeout), the server closes and the
process exits 0. A second signal stops at once. Shards that die or restart do not stop the
router: its watchdog reconnects to the same addresses and re-warms them (see core/watchdog.py).

The event loop: uvloop where it is installed (Linux, macOS), else asyncio's. uvloop cuts the
router's CPU per streamed token by about a fifth (its socket writes, polling and callback dispatch
are C). The benchmark's load generator and in-process rows use the same loop, so that they measure
the router as it runs.

Log output: human-readable lines, or one JSON object per line (--json-output).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import uvicorn

from pytgi_proto.contracts import JsonFormatter
from pytgi_router.core.infer import Infer
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.core.watchdog import Watchdog
from pytgi_router.http.app import create_app
from pytgi_router.http.grammar import GrammarLimits
from pytgi_router.http.http_protocol import bounded_protocol
from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.http.media.prepare import ImagePreparer
from pytgi_router.http.media.vision_model import image_support
from pytgi_router.http.model_files import ModelFiles, pipeline_tag, snapshot_sha
from pytgi_router.http.openai.chat_template import load_chat_template
from pytgi_router.http.reasoning import chosen_parser
from pytgi_router.http.sse import RawSend
from pytgi_router.http.state import AppState
from pytgi_router.http.validation import ValidationLimits, Validator
from pytgi_router.metrics import Metrics
from pytgi_router.settings import RouterSettings
from pytgi_router.tracing import Tracing

log = logging.getLogger("pytgi.router")

T = TypeVar("T")

# Grace the HTTP server gives open connections once the drain is over (a response finishing).
CLOSE_GRACE_S = 3.0
# One reconnection attempt's wait for the shards' sockets: short, so that a group that comes
# back is found within a second or two by the watchdog's next attempt.
RECONNECT_TIMEOUT_S = 3.0
# Idle keep-alive connections stay open longer than load balancers keep theirs (AWS: 60 s) and
# than clients pool them (httpx: 5 s), so that the client side always closes first: with a
# server's usual 5 s, a client reusing a connection just as the server drops it gets a reset.
KEEP_ALIVE_S = 75.0


def bind_socket(host: str, port: int) -> socket.socket:
    """Binds here (not in the HTTP server) so that port 0 resolves to a real port to announce."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock



def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on new_event_loop()."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)



def announce(message: str, json_output: bool) -> None:
    """A line that must always be printed (e.g. "ready"), whatever LOG_LEVEL says."""
    if json_output:
        record = logging.LogRecord("pytgi.router", logging.INFO, "", 0, message, None, None)
        print(JsonFormatter().format(record), flush=True)
    else:
        print(message, flush=True)


def configure_logging(json_output: bool) -> None:
    """Called once from the CLI; LOG_LEVEL (TGI's variable) picks the level, default INFO."""
    handler = logging.StreamHandler(sys.stdout)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    root.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
    # Uvicorn's start/stop banners and access lines would double the router's own lines.
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


class RouterServer:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.tracing = Tracing(settings.otlp_endpoint, settings.otlp_service_name)
        self.state: AppState | None = None
        self._infer: Infer | None = None
        self._watchdog: Watchdog | None = None
        # The image intake (vision models): its fetcher's HTTP client is closed on shutdown.
        self._intake: ImageIntake | None = None
        self._executor = ThreadPoolExecutor(settings.validation_workers, "pytgi-validation")
        self._stop = asyncio.Event()
        self._draining: asyncio.Task[None] | None = None
        self.sock: socket.socket | None = None
        self._port = 0

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> AppState:
        s = self.settings
        self.tracing.install_global()
        files = ModelFiles(s.tokenizer_name, s.revision)
        tokenizer = files.tokenizer()
        template = load_chat_template(files, s.tokenizer_config_path)
        if template is None:
            log.warning("no chat template found: /v1/chat/completions will answer 422")
        reasoning, why = chosen_parser(s.reasoning_parser, template.source if template else None)
        log.info(why)
        traced = self.tracing.enabled
        client = await ShardClient.connect(s.shard_uri, traced=traced, token=s.shard_token)
        metrics = Metrics(s.max_input_tokens or 1024, s.max_total_tokens or 2048)
        # Reconnection reaches the same addresses: a restarted shard group listens there again.
        infer = self._infer = Infer(
            client, s.infer_settings(), metrics,
            lambda: ShardClient.connect(s.shard_uri, RECONNECT_TIMEOUT_S, traced, s.shard_token),
        )
        info = await infer.start()
        self._watchdog = Watchdog(infer)
        self._watchdog.start()
        limits = ValidationLimits(
            max_best_of=s.max_best_of,
            max_stop_sequences=s.max_stop_sequences,
            max_top_n_tokens=s.max_top_n_tokens,
            max_input_tokens=info.max_input_tokens,
            max_total_tokens=info.max_total_tokens,
            grammar_supported=not s.disable_grammar_support,
            grammar=GrammarLimits(max_bytes=s.max_grammar_bytes),
            adapters=info.lora_adapters,
        )
        validator = Validator(tokenizer, limits, self._executor, adapters=infer.adapters)
        config = files.read_json("config.json")
        images = image_support(config, files.read_json("preprocessor_config.json"), tokenizer)
        if images.vision is not None:
            intake = self._intake = ImageIntake(s.media_limits(), self._executor)
            validator.images = ImagePreparer(images.vision, intake)
        log.info(images.describe())
        self.state = AppState(
            settings=s, infer=infer, info=info, validator=validator, metrics=metrics,
            chat_template=template, reasoning=reasoning, tracing=self.tracing,
            model_sha=snapshot_sha(files.find("tokenizer.json")),
            model_pipeline_tag=pipeline_tag(config),
            architectures=tuple(a for a in (config or {}).get("architectures") or []
                                if isinstance(a, str)),
            images=images,
        )
        self.sock = bind_socket(s.hostname, s.port)
        self._port = int(self.sock.getsockname()[1])
        return self.state

    async def serve(self) -> None:
        """Serves until shutdown; start() must have run."""
        assert self.state is not None and self.sock is not None
        # Uvicorn with the httptools parser (bounds: see http/http_protocol.py): its per-chunk
        # send is a few Python lines around one transport write, which matters on the streaming
        # hot path (one send per token per client). No signal capture (ours drain first), no
        # proxy-header rewriting, no lifespan.
        config = uvicorn.Config(
            RawSend(create_app(self.state)),
            http=bounded_protocol(self.settings.max_connections),
            ws="none",
            lifespan="off",
            loop="none",
            proxy_headers=False,
            server_header=False,
            access_log=False,
            log_config=None,
            timeout_keep_alive=int(KEEP_ALIVE_S),
            timeout_graceful_shutdown=int(CLOSE_GRACE_S),
        )
        server = uvicorn.Server(config)
        host = self.settings.hostname
        shown = f"[{host}]" if ":" in host else host
        announce(f"Connected, serving on http://{shown}:{self.port}", self.settings.json_output)
        log.info("model %s: %s", self.state.model_id, self.state.info)

        async def stop_when_asked() -> None:
            await self._stop.wait()
            server.should_exit = True

        stopper = asyncio.ensure_future(stop_when_asked())
        try:
            # _serve is serve() without its signal capture, which would stop at once on SIGTERM
            # and re-raise the signal after: the drain in request_shutdown owns the signals.
            await server._serve(sockets=[self.sock])
        finally:
            stopper.cancel()

    def request_shutdown(self) -> None:
        """First call: drain, then stop. Second call: stop now."""
        if self._draining is None:
            log.info("shutdown requested: not ready for %gs (still admitting), then draining "
                     "in-flight requests", self.settings.drain_grace_seconds)
            self._draining = asyncio.ensure_future(self._drain())
        else:
            log.info("second shutdown request: stopping now")
            self._stop.set()

    async def _drain(self) -> None:
        state = self.state
        if state is not None:
            state.not_ready = True
            await asyncio.sleep(self.settings.drain_grace_seconds)
            state.draining = True
            log.info("drain: no longer admitting; %d request(s) in flight",
                     max(state.in_flight, state.infer.in_flight))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.settings.graceful_termination_timeout
            while (state.in_flight or state.infer.in_flight) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self._stop.set()

    async def close(self) -> None:
        if self._watchdog is not None:
            await self._watchdog.stop()
        if self._infer is not None:
            await self._infer.stop(0.0)
            await self._infer.client.close()
        if self._intake is not None:
            await self._intake.aclose()
        if self._draining is not None:
            self._draining.cancel()
        if self.sock is not None:
            self.sock.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.tracing.shutdown()


async def serve(settings: RouterSettings) -> int:
    server = RouterServer(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_shutdown)
    try:
        await server.start()
        await server.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await server.close()
    log.info("router stopped")
    return 0


def run(settings: RouterSettings) -> int:
    try:
        return run_event_loop(serve(settings))
    except Exception as err:
        log.error("router failed: %s", err, exc_info=log.isEnabledFor(logging.DEBUG))
        print(f"pytgi-router: error: {err}", flush=True)
        return 1
