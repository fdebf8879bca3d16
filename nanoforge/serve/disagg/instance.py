"""Instance roles: `nanoforge serve --role prefill|decode|both [--store MASTER]`.

An instance is today's server (the OpenAI endpoints, `/health`, `/metrics`)
whose engine shares prompt blocks through the KV pool when `--store` names a
`mooncake_master`, plus the conductor's endpoints (`handover.py` has the protocol):

    GET  /disagg/info       role, model, context, cache layout, limits, tokenizer: what the conductor needs
    POST /disagg/prefill    prefill (and both): compute the prompt and first tokens, save the blocks, answer
    POST /disagg/decode     decode (and both): resume with the first tokens, stream the rest as NDJSON events
    POST /disagg/generate   both: the whole request on this instance, streamed as /disagg/decode's events (a
                            conductor over colocated instances: `nanoforge conductor --colocated`)

A prefill instance saves every computed prompt block to the pool and answers
only once the save is done (at most `SAVE_TIMEOUT_S`; past that the decode
instance computes what it does not find). A decode instance loads what the
pool holds and saves nothing. `both` does both: with a pool it is a colocated
server that shares its prefixes with the cluster; without, today's server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoforge.errors import InternalError, NanoforgeError
from nanoforge.serve.api.app import build_app, engine_config, serve_app, served_model_name, start_line
from nanoforge.serve.api.protocol import DEFAULT_MAX_REQUEST_BYTES, error_body, read_json
from nanoforge.serve.api.streaming import collect, unless_disconnected
from nanoforge.serve.disagg.handover import SAVE_TIMEOUT_S, OutputEncoder, parse_handover
from nanoforge.serve.llm_engine import LLMEngine

log = logging.getLogger("nanoforge.serve")

ROLES = ("prefill", "decode", "both")


def instance_info(engine: LLMEngine, role: str, model_name: str) -> dict:
    """What the conductor learns from an instance (`GET /disagg/info`)."""
    cfg = engine.scheduler.config
    connector = engine.connector
    return {"role": role, "model": model_name, "max_model_len": engine.max_model_len, "block_size": cfg.block_size,
            "vocab_size": cfg.vocab_size, "max_num_seqs": cfg.max_num_seqs, "num_gpu_blocks": cfg.num_gpu_blocks,
            "eos_token_ids": list(cfg.eos_token_ids),
            "kv_namespace": connector.namespace if connector else None,
            "kv_block_bytes": connector.slot_bytes if connector else None,
            "tokenizer": engine.tokenizer.to_dict()}


def add_role_routes(app: FastAPI, role: str, model_name: str,
                    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """The conductor's endpoints on a server made by `build_app`."""
    if role not in ROLES:
        raise NanoforgeError(f"--role must be one of {', '.join(ROLES)}, got {role!r}", param="role")
    engine = app.state.engine  # the AsyncEngine
    info = instance_info(engine.engine, role, model_name)

    @app.get("/disagg/info")
    async def disagg_info():
        return info

    async def prefill(request: Request) -> Response:
        rid, prompt, params, _ = parse_handover(await read_json(request, max_request_bytes), resume=False)
        arrival = time.monotonic()
        stream = await engine.add([prompt], params, request_id=rid, arrival_time=arrival)
        finals = await unless_disconnected(request, collect(stream))
        if finals is None:
            return Response(status_code=499)  # the conductor left (its client did)
        out = finals[0]
        first = out.metrics.get("first_token_time") or out.metrics.get("finish_time")
        saved = None
        if out.kv_save is not None:
            try:
                saved = await asyncio.wait_for(asyncio.wrap_future(out.kv_save), SAVE_TIMEOUT_S)
            except TimeoutError:
                pass  # the decode instance computes what it does not find
        return JSONResponse({"output": OutputEncoder().event(out), "saved_blocks": saved,
                             "prefill_s": first - arrival, "computed_tokens": len(prompt) - out.num_cached_tokens})

    async def decode(request: Request) -> Response:
        rid, prompt, params, outputs = parse_handover(await read_json(request, max_request_bytes), resume=True)
        stream = await engine.add([prompt], params, request_id=rid, arrival_time=time.monotonic(),
                                  outputs=[outputs])
        return streamed(stream)

    async def generate(request: Request) -> Response:
        rid, prompt, params, _ = parse_handover(await read_json(request, max_request_bytes), resume=False)
        return streamed(await engine.add([prompt], params, request_id=rid, arrival_time=time.monotonic()))

    def streamed(stream) -> StreamingResponse:
        """A request's outputs as NDJSON events (`OutputEncoder`), an error as a last event."""

        async def events():
            encoder = OutputEncoder()
            try:
                async for _, out in stream:
                    yield json.dumps(encoder.event(out), separators=(",", ":")) + "\n"
            except NanoforgeError as e:
                yield json.dumps({**error_body(str(e), e.status, e.param), "status": e.status}) + "\n"
            except InternalError as e:  # logged by the engine thread
                yield json.dumps({**error_body(str(e), 500), "status": 500}) + "\n"
            finally:
                stream.abort()  # the conductor left, or we failed: free the blocks

        return StreamingResponse(events(), media_type="application/x-ndjson")

    if role in ("prefill", "both"):
        app.add_api_route("/disagg/prefill", prefill, methods=["POST"])
    if role in ("decode", "both"):
        app.add_api_route("/disagg/decode", decode, methods=["POST"])
    if role == "both":
        app.add_api_route("/disagg/generate", generate, methods=["POST"])


def run_instance(args) -> int:
    """`nanoforge serve --role R [--store MASTER]`: an instance for the conductor."""
    pool = None
    if args.store:
        from nanoforge.serve.disagg.mooncake_store import MooncakeStore

        pool = MooncakeStore(args.store, segment_bytes=int(args.pool_memory * 2**30), hostname=args.store_hostname)
    config = engine_config(args)
    config.kv_pool_save = args.role != "decode"
    try:
        engine = LLMEngine.from_pretrained(args.model, config, kv_pool=pool)
        if pool is not None:  # take requests once the pool segment is resident (its pre-faulting overlapped the load)
            waited = pool.wait_warm()
            if waited > 1:
                log.info("waited %.1f s for the KV pool segment to be resident", waited)
        name = served_model_name(args)
        app = build_app(engine, name, max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes)
        add_role_routes(app, args.role, name, args.max_request_bytes)
        where = f"KV pool of the master at {args.store}" if pool else "no KV pool"
        banner = (f"nanoforge serve: {name} at {{url}} (role {args.role}, {where}, context {engine.max_model_len} "
                  f"tokens, {engine.stats()['kv_blocks_total']} KV blocks; {start_line(engine)})")
        try:
            return serve_app(app, args, banner)
        finally:
            engine.close()
    finally:
        if pool is not None:
            pool.close()
