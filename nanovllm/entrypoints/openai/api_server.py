"""`nanovllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on AsyncLLMEngine.

Endpoints: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (both with `stream`). Listens on 127.0.0.1 unless told otherwise.
"""
import argparse
import hmac
import json
import logging
import os
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ModelCard,
                                                  ModelList)
from nanovllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("nanovllm.serve")

API_KEY_ENV = "NANOVLLM_API_KEY"
_UNAUTHENTICATED_PATHS = ("/health",)  # probes must work without credentials

# serve's engine options and the Config fields they set (only when given).
_ENGINE_OPTIONS = ("device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enforce_eager",
                   "kv_cache_memory_bytes", "num_kvcache_blocks", "gpu_memory_utilization", "tensor_parallel_size",
                   "enable_prefix_caching", "kvcache_block_size", "seed", "attention_backend", "load_format",
                   "kv_cache_dtype", "quantization")


def add_serve_arguments(p: argparse.ArgumentParser):
    from nanovllm.models.default_model import DEFAULT_MODEL_NAME
    p.add_argument("model", nargs="?", default=None,
                   help=f"model directory or .gguf file (default: the embedded {DEFAULT_MODEL_NAME})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (or set ${API_KEY_ENV})")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model` (default: the MODEL argument, or the default model's name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests allowed to wait for a batch slot; beyond it new ones get 503 (default: 1024)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body accepted, in bytes; larger ones get 413 (default: 8 MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g = p.add_argument_group("engine options (nanovllm.config.Config)")
    g.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kvcache-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--kvcache-block-size", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"])
    g.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"])
    g.add_argument("--seed", type=int, default=None, help="seed of requests that give none")
    g.add_argument("--kv-cache-dtype", default=None, help="auto (the model dtype) or fp8 (float8_e4m3fn)")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="block-FP8 weights for a checkpoint without them (FP8 checkpoints need no flag)")


# ---- the app --------------------------------------------------------------------------------
def build_app(engine: AsyncLLMEngine, model_names: list[str], metrics: ServerMetrics | None = None,
              api_key: str | None = None, max_body_bytes: int = 8 << 20) -> FastAPI:
    from nanovllm.engine.tokenizer import load_tokenizer
    config = engine.config
    serving = OpenAIServing(engine, load_tokenizer(config.model), model_names)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        engine.shutdown()  # on uvicorn's shutdown, once open connections are done

    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI (and its clients) expect 400 with a message naming the field.
        problems, param = [], None
        for err in exc.errors()[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                problems.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            where = ".".join(loc)
            param = param or (loc[0] if loc else None)
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(APIError("; ".join(problems) or "invalid request", 400, param=param).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):  # unknown route, wrong method...
        return JSONResponse(APIError(str(exc.detail), exc.status_code).body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        logger.exception("unhandled error", exc_info=exc)
        return JSONResponse(APIError(f"internal server error: {type(exc).__name__}", 500).body(), 500)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "unhealthy", "reason": engine.dead or "the engine is stopped"}, 503)
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        text = metrics.render(engine.stats) if metrics is not None else ""
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=config.model, max_model_len=config.max_model_len,
                           vocab_size=config.hf_config.vocab_size) for name in model_names]
        return ModelList(data=cards).model_dump(mode="json")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


class GuardMiddleware:
    """Authentication and the body-size bound, as plain ASGI, before FastAPI reads anything.

    The body is read here, up to the bound, and replayed to the app; a Content-Length over the
    bound is refused without reading. Either way an endless upload cannot exhaust memory."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in _UNAUTHENTICATED_PATHS:
            # compare_digest: the time taken does not tell how much of a guess was right.
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _send_error(send, APIError("invalid or missing API key: send 'Authorization: "
                                                        "Bearer <key>'", 401, code="invalid_api_key"))
        too_large = APIError(f"the request body exceeds {self.max_body_bytes} bytes", 413, code="request_too_large")
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _send_error(send, APIError("invalid Content-Length header", 400))
        if length > self.max_body_bytes:
            return await _send_error(send, too_large)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:  # a chunked upload that never said how long it is
                return await _send_error(send, too_large)
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then: the disconnect, which the handlers watch for
        await self.app(scope, replay, send)


async def _send_error(send, error: APIError):
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status == 413:
        headers.append((b"connection", b"close"))  # the rest of the upload is not going to be read
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- running it -----------------------------------------------------------------------------
def engine_config(args) -> Config:
    from nanovllm.models.model_path import resolve_model_path
    kwargs = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name, None) is not None}
    return Config(resolve_model_path(args.model), **kwargs)


def run_server(args) -> int:
    from nanovllm.models.default_model import DEFAULT_MODEL_NAME

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    for name, value, low in (("--port", args.port, 0), ("--max-waiting", args.max_waiting, 1),
                             ("--max-body-bytes", args.max_body_bytes, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    names = args.served_model_name or [args.model if args.model is not None else DEFAULT_MODEL_NAME]
    config = engine_config(args)  # bad options fail here, before the model loads
    metrics = ServerMetrics(names[0])
    engine = AsyncLLMEngine(config, max_waiting=args.max_waiting, listener=metrics)
    logger.info("loading %s (%s) on %s", names[0], config.model, config.device)
    engine.start()
    app = build_app(engine, names, metrics, api_key, args.max_body_bytes)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    access_log=args.access_log, timeout_graceful_shutdown=5,
                                    log_config=None), engine)
    logger.info("serving %s on http://%s:%d (API key %s)", ", ".join(names), args.host, args.port,
                "required" if api_key else "not required")
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it caught, once shut down
        pass
    finally:
        engine.shutdown()
    return 0


class _Server(uvicorn.Server):
    """On SIGINT/SIGTERM, besides uvicorn's (stop accepting connections, wait for open ones):
    stop taking requests and abort those in flight, so open streams end at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.begin_shutdown()  # only puts a command on a queue: safe in a signal handler
        super().handle_exit(sig, frame)


if __name__ == "__main__":  # the same as `nanovllm serve` (the CLI sits above this module, not below it)
    _parser = argparse.ArgumentParser(prog="python -m nanovllm.entrypoints.openai.api_server")
    add_serve_arguments(_parser)
    _args = _parser.parse_args()
    try:
        sys.exit(run_server(_args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        _parser.error(str(e))
