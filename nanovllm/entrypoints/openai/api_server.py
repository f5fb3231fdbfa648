"""`nanovllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on AsyncLLMEngine.

Endpoints: GET /health (liveness: 200 while an engine core serves, saying which are down), GET /ready
(readiness: 503 while draining or when no core serves), GET /metrics (Prometheus), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (both with `stream`). Listens on 127.0.0.1 unless
told otherwise. With --data-parallel-size N, N engine cores behind this one front end
(engine/data_parallel.py).
Before the app: http_guard.py (authentication, the drain, body bounds and timeouts); around it:
http_server.py (a deadline for request heads, the drain on SIGTERM).
"""
import argparse
import gc
import logging
import os
import resource
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.engine.data_parallel import DataParallelEngine, check_data_parallel
from nanovllm.entrypoints.openai.http_guard import RETRY_AFTER_S, Admission, GuardMiddleware
from nanovllm.entrypoints.openai.http_server import Server, guarded_h11
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, ModelCard, ModelList, TokenizeRequest)
from nanovllm.entrypoints.openai.request_body import parse_request, validation_error
from nanovllm.entrypoints.openai.serving import OpenAIServing
from nanovllm.entrypoints.openai.tokenization import Tokenization
from nanovllm.reasoning import REASONING_PARSERS

logger = logging.getLogger("nanovllm.serve")

API_KEY_ENV = "NANOVLLM_API_KEY"
_CONNECTIONS_HEADROOM = 256  # --limit-concurrency's default: requests that may run or wait, plus these

# serve's engine options and the Config fields they set (only when given).
_ENGINE_OPTIONS = ("device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enforce_eager",
                   "kv_cache_memory_bytes", "num_kvcache_blocks", "gpu_memory_utilization", "tensor_parallel_size",
                   "enable_prefix_caching", "kvcache_block_size", "seed", "attention_backend", "load_format",
                   "reasoning_parser", "kv_cache_dtype", "quantization", "speculative_config", "cpu_threads")


def add_serve_arguments(p: argparse.ArgumentParser):
    from nanovllm.models.default_model import DEFAULT_MODEL_NAME
    p.add_argument("model", nargs="?", default=None,
                   help=f"model directory or .gguf file (default: the embedded {DEFAULT_MODEL_NAME})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health and /ready (or set ${API_KEY_ENV})")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model` (default: the MODEL argument, or the default model's name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests allowed to wait for a batch slot; beyond it new ones get 503 (default: 1024)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body accepted, in bytes; larger ones get 413 (default: 8 MiB)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open (default: 5)")
    p.add_argument("--timeout-header", type=float, default=10.0,
                   help="seconds a request's line and headers may take to arrive, from their first byte "
                        "(and a new connection's first request, from its opening); then 408 (default: 10)")
    p.add_argument("--timeout-body", type=float, default=30.0,
                   help="longest wait, in seconds, for the next piece of a request body; then 408 (default: 30)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="most connections and requests at once; beyond, new requests get 503 (default: "
                        f"--max-waiting + --max-num-seqs + {_CONNECTIONS_HEADROOM})")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds the requests in flight may take to finish while new ones get "
                        "503; then they end with finish_reason 'abort' (default: 30)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores behind this server, each with a replica of the model and a KV cache of its "
                        "own (on CUDA: --tensor-parallel-size devices each, from --device on; on the CPU: they "
                        "split the cores); requests go to the least loaded, or to one holding their prefix")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV-cache block events (vLLM's format, msgpack over ZMQ PUB) for prefix-aware "
                        "routers: tcp://*:PORT binds, tcp://HOST:PORT connects; engine core i uses PORT+i "
                        "(needs pip install 'nanovllm[kv_events]')")
    p.add_argument("--kv-events-topic", default="", help="the ZMQ topic of the KV-cache events (default: none)")
    p.add_argument("--kv-events-format", default="array", choices=["array", "map"],
                   help="how events are encoded: 'array' (vLLM up to 0.10, llm-d's indexer) or 'map' (tagged maps, "
                        "later vLLM) (default: array)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g = p.add_argument_group("engine options (nanovllm.config.Config)")
    g.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--cpu-threads", type=int, default=None, help="torch threads on the CPU (default: physical cores)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kvcache-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--kvcache-block-size", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"])
    g.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"])
    g.add_argument("--seed", type=int, default=None, help="seed of requests that give none")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's <think> block into reasoning_content; constraints apply after it")
    g.add_argument("--kv-cache-dtype", default=None, help="auto (the model dtype) or fp8 (float8_e4m3fn)")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="block-FP8 weights for a checkpoint without them (FP8 checkpoints need no flag)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\'')


# ---- the app --------------------------------------------------------------------------------
def build_app(engine: AsyncLLMEngine | DataParallelEngine, model_names: list[str],
              metrics: ServerMetrics | None = None,
              api_key: str | None = None, max_body_bytes: int = 8 << 20, body_timeout: float | None = None,
              admission: Admission | None = None) -> FastAPI:
    from nanovllm.engine.tokenizer import load_tokenizer
    config = engine.config
    serving = OpenAIServing(engine, load_tokenizer(config.model), model_names)
    tokenization = Tokenization(serving)
    admission = admission or Admission()

    @asynccontextmanager
    async def lifespan(_app):
        yield
        serving.tokenize_pool.shutdown()
        engine.shutdown()  # on uvicorn's shutdown, once open connections are done

    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None  # overloaded, or stopping
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI (and its clients) expect 400 with a message naming the field.
        return JSONResponse(validation_error(exc.errors()).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):  # unknown route, wrong method...
        return JSONResponse(APIError(str(exc.detail), exc.status_code).body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        logger.exception("unhandled error", exc_info=exc)
        return JSONResponse(APIError(f"internal server error: {type(exc).__name__}", 500).body(), 500)

    def engine_report() -> list[dict]:
        return [{"engine": str(i), "status": "ok"} if reason is None else
                {"engine": str(i), "status": "down", "reason": reason} for i, reason in engine.core_states()]

    @app.get("/health")
    async def health():
        """Liveness: 200 while at least one engine core serves (a degraded server says which are down)."""
        report = engine_report()
        if not engine.healthy:
            return JSONResponse({"status": "unhealthy", "reason": engine.dead or "the engine is stopped",
                                 "engines": report}, 503)
        if admission.draining or not engine.accepting:
            return JSONResponse({"status": "shutting down"}, 503)
        if any(e["status"] != "ok" for e in report):
            return {"status": "degraded", "engines": report}
        return {"status": "ok", "engines": report} if len(report) > 1 else {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """Readiness (a load balancer's or Kubernetes' readinessProbe): 503 while draining or when no
        engine core serves, so traffic goes elsewhere."""
        if not engine.healthy:
            reason = engine.dead or "the engine is stopped"
        elif admission.draining or not engine.accepting:
            reason = "the server is shutting down"
        else:
            return {"status": "ready"}
        return JSONResponse({"status": "not ready", "reason": reason}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics")
    async def get_metrics(raw: Request):
        if metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        body, content_type = metrics.render(raw.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=config.model, max_model_len=config.max_model_len,
                           vocab_size=config.hf_config.vocab_size) for name in model_names]
        return ModelList(data=cards).model_dump(mode="json")

    # Bodies are parsed here, not by FastAPI: strict JSON (request_body.py).
    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await serving.completions(await parse_request(await raw.body(), CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await serving.chat(await parse_request(await raw.body(), ChatCompletionRequest), raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await tokenization.tokenize(await parse_request(await raw.body(), TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await tokenization.detokenize(await parse_request(await raw.body(), DetokenizeRequest))

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                       admission=admission)
    return app


# ---- running it -----------------------------------------------------------------------------
def engine_config(args) -> Config:
    from nanovllm.models.model_path import resolve_model_path
    kwargs = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name, None) is not None}
    return Config(resolve_model_path(args.model), **kwargs)


def run_server(args) -> int:
    from nanovllm.models.default_model import DEFAULT_MODEL_NAME

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    limit = args.limit_concurrency
    for name, value, low in (("--port", args.port, 0), ("--max-waiting", args.max_waiting, 1),
                             ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--limit-concurrency", 1 if limit is None else limit, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    for name in ("timeout_keep_alive", "timeout_header", "timeout_body", "shutdown_timeout"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    names = args.served_model_name or [args.model if args.model is not None else DEFAULT_MODEL_NAME]
    config = engine_config(args)  # bad options fail here, before the model loads
    dp = args.data_parallel_size
    check_data_parallel(config, dp)
    if args.kv_events_endpoint is not None:
        _check_kv_events(args.kv_events_endpoint, dp)
    limit_concurrency = args.limit_concurrency or \
        (args.max_waiting + config.max_num_seqs) * dp + _CONNECTIONS_HEADROOM
    _raise_open_files_limit(limit_concurrency)
    spec = config.speculative_config
    metrics = ServerMetrics(names[0], config.max_model_len, spec.num_speculative_tokens if spec is not None else 0)
    engine = DataParallelEngine(config, dp, args.max_waiting, [metrics.engine_listener(i) for i in range(dp)],
                                kv_events_endpoint=args.kv_events_endpoint, kv_events_topic=args.kv_events_topic,
                                kv_events_format=args.kv_events_format)
    logger.info("loading %s (%s) on %s%s", names[0], config.model, config.device,
                f" ({dp} engine cores)" if dp > 1 else "")
    engine.start()
    admission = Admission()
    app = build_app(engine, names, metrics, api_key, args.max_body_bytes, args.timeout_body, admission)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=args.access_log, timeout_graceful_shutdown=5, log_config=None,
                                   http=guarded_h11(args.timeout_header), timeout_keep_alive=args.timeout_keep_alive,
                                   limit_concurrency=limit_concurrency),
                    engine, admission, args.shutdown_timeout)
    logger.info("serving %s on http://%s:%d (API key %s)", ", ".join(names), args.host, args.port,
                "required" if api_key else "not required")
    # What exists now (the libraries, the app, the tokenizer: ~240k objects) lives as long as the
    # server: frozen, out of the cyclic collector's reach. Otherwise each full collection under load
    # walks it all, a 70-80 ms pause of the event loop on the 2-core CPU machine, three in a 7 s
    # multi-turn run, each landing in the TTFT of the requests it holds up (BENCHMARKS.md).
    gc.collect()
    gc.freeze()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0


def _check_kv_events(endpoint: str, dp: int):
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--kv-events-endpoint needs pyzmq and msgspec ({e}): pip install 'nanovllm[kv_events]'") \
            from None
    from nanovllm.engine.kv_events import check_endpoint, endpoint_for_rank
    check_endpoint(endpoint)
    for rank in range(dp):
        endpoint_for_rank(endpoint, rank)


def _raise_open_files_limit(connections: int):
    """Each connection is a file descriptor: lift the soft limit (often 1024) toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256  # the engine's pipes, the model's files, the tokenizer's...
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < wanted:
            logger.warning("only %d files may be open (ulimit -n): fewer than --limit-concurrency %d needs",
                           target, connections)


if __name__ == "__main__":  # the same as `nanovllm serve` (the CLI sits above this module, not below it)
    _parser = argparse.ArgumentParser(prog="python -m nanovllm.entrypoints.openai.api_server")
    add_serve_arguments(_parser)
    _args = _parser.parse_args()
    try:
        sys.exit(run_server(_args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        _parser.error(str(e))
