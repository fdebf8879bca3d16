"""The app: OpenAI's routes over a frontend, the single server (`nanoforge serve --model DIR`), and uvicorn.

`openai_app` routes the endpoints to a *frontend*, whatever runs requests:

    add(prompts, params, request_id=, arrival_time=) -> OutputStream   queue, or raise NanoforgeError (400, 429, 503)
    stats_async() -> dict       gauges for /metrics          is_alive      /health
    stop_accepting()            new requests get 503         abort_all(reason)   end those in flight

The single server's frontend is an `AsyncEngine` over one `LLMEngine`
(`build_app`); the conductor's sends each request to a prefill and a decode
instance (`serve/disagg/conductor.py`). Both parse with `protocol.RequestParser`
and answer with `streaming.respond`, so their bodies, streams, errors and
`/metrics` are the same.

On SIGTERM, `Server` stops accepting, lets requests in flight finish for
`--shutdown-timeout` seconds, then ends the rest with an error event and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoforge.errors import InternalError, NanoforgeError
from nanoforge.serve.api.metrics import Metrics
from nanoforge.serve.api.protocol import DEFAULT_MAX_REQUEST_BYTES, RequestParser, error_body, error_response
from nanoforge.serve import layer_kernel
from nanoforge.serve.api.streaming import respond
from nanoforge.serve.async_engine import AsyncEngine
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine

log = logging.getLogger("nanoforge.serve")


def openai_app(frontend, parser: RequestParser, metrics: Metrics, lifespan: Callable, *,
               title: str = "nanoforge") -> FastAPI:
    """OpenAI's endpoints over `frontend`: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.
    `lifespan(app)` is the async context manager that starts and stops the frontend; `app.state.frontend`
    is the frontend."""
    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = frontend

    @app.exception_handler(NanoforgeError)
    async def nanoforge_error(request: Request, e: NanoforgeError):
        metrics.rejected.labels(str(e.status)).inc()
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found"}.get(e.status_code)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", e.status_code, code=code),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(InternalError)
    async def engine_failure(request: Request, e: InternalError):  # logged where it happened already
        metrics.rejected.labels("500").inc()
        return JSONResponse(error_body(str(e), 500), status_code=500)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        metrics.rejected.labels("500").inc()
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)

    async def run(request: Request, parse) -> Response:
        parsed = await parse(request)
        # a response sent whole needs each prompt's last output only
        params = parsed.params if parsed.stream else dataclasses.replace(parsed.params, output_kind="final_only")
        stream = await frontend.add(parsed.prompts, params, request_id=parsed.request_id,
                                    arrival_time=parsed.arrival)
        return await respond(request, parsed, stream, parser.model_name, parser.tokenizer)

    async def completions(request: Request) -> Response:
        return await run(request, parser.completion)

    async def chat(request: Request) -> Response:
        return await run(request, parser.chat)

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [parser.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        parser.check_model_name(model)
        return parser.model_card()

    @app.get("/health")
    async def health():
        if not frontend.is_alive:
            raise NanoforgeError("the engine is not running", status=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.collector.stats = await frontend.stats_async()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def build_app(engine: LLMEngine, model_name: str, *, max_waiting: int = 256,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The single server: a FastAPI app serving `engine` as `model_name`. Its lifespan starts and stops the
    engine thread; `app.state.engine` is the AsyncEngine (e.g. for `.stats()`)."""
    if engine.tokenizer is None:
        raise NanoforgeError("the server needs an engine with a tokenizer (text, chat, stop strings)",
                             param="tokenizer")
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = Metrics()
    async_engine.on_finished = metrics.observe
    parser = RequestParser(engine.tokenizer, model_name, engine.max_model_len, max_batch=max_waiting,
                           max_request_bytes=max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = openai_app(async_engine, parser, metrics, lifespan)
    app.state.engine = async_engine
    return app


class Server(uvicorn.Server):
    """uvicorn, with a graceful drain: on shutdown (SIGTERM, SIGINT) new requests get 503 at once; those in
    flight have `grace` seconds to finish, then end with an error event (streams) or a 503."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, grace: float = 30.0,
                 log_level: str = "info"):
        # uvicorn's own deadline comes after ours, so requests end with our error, not a cut connection
        # (one access-log line per request costs the event loop more than it tells; on with log_level "debug")
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        access_log=log_level == "debug", timeout_graceful_shutdown=grace + 5))
        self.frontend = app.state.frontend
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        self.frontend.stop_accepting()
        deadline = asyncio.get_running_loop().call_later(
            self.grace, self.frontend.abort_all, f"the server shut down before the request finished "
                                                 f"(--shutdown-timeout {self.grace:g} s)")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def engine_config(args) -> EngineConfig:
    """The engine settings of `nanoforge serve`'s flags."""
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        kv_cache_memory=int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=not args.no_prefix_caching, device=args.device, dtype=args.dtype,
                        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                        async_scheduling=getattr(args, "async_scheduling", None),
                        graph_prefill=getattr(args, "graph_prefill", None),
                        kv_pool_workers=getattr(args, "kv_pool_workers", EngineConfig.kv_pool_workers))


def served_model_name(args) -> str:
    return args.served_model_name or Path(args.model).resolve().name


def serve_app(app: FastAPI, args, banner: str, on_ready=None) -> int:
    """Bind `args.host:args.port`, print `banner` with the address, serve until SIGTERM / Ctrl-C.

    The first line printed is "...at http://HOST:PORT/v1 ..." (launchers and tests read it). `on_ready(base_url)`,
    if given, runs in a thread once the server accepts requests."""
    server = Server(app, args.host, args.port, grace=args.shutdown_timeout, log_level=args.log_level)
    sock = server.config.bind_socket()
    host, port = sock.getsockname()[:2]
    print(banner.format(url=f"http://{host}:{port}/v1"), flush=True)
    if on_ready is not None:
        def wait_then_call():
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                on_ready(f"http://{host}:{port}/v1")

        threading.Thread(target=wait_then_call, daemon=True).start()
    server.run(sockets=[sock])
    return 0


def run_server(args, on_ready=None) -> int:
    """`nanoforge serve`: load the model, bind, print the address, serve until SIGTERM / Ctrl-C.

    `on_ready(base_url)`, if given, runs in a thread once the server accepts requests."""
    engine = LLMEngine.from_pretrained(args.model, engine_config(args))
    name = served_model_name(args)
    app = build_app(engine, name, max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes)
    return serve_app(app, args, f"nanoforge serve: {name} at {{url}} (context {engine.max_model_len} tokens, "
                                f"{engine.stats()['kv_blocks_total']} KV blocks; {start_line(engine)})", on_ready)


def start_line(engine: LLMEngine) -> str:
    """What the engine's start cost, for the server's first line (and what NANOFORGE_DECODE_LAYERS=auto chose)."""
    chose, spent = engine.runner.decode_layers, engine.runner.start_s
    layers = f"; batch-1 decode layers: {layer_kernel.describe(chose)}" if chose else ""
    timed = f", {spent['decode_layers']:.1f} s timing the decode layers' ways" if chose else ""
    return (f"engine started in {engine.runner_start_s:.1f} s ({engine.runner_tuning_s:.1f} s tuning the skinny "
            f"matmul, {spent['capture']:.1f} s capturing {len(engine.runner.graphs)} CUDA graphs{timed}){layers}")
