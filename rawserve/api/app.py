"""Assemble the OpenAI server: tokenizer, template and defaults from the checkpoint, the engine frontend,
the routes (each with its access line), and the HTTP server's lifecycle (start, startup summary, stats
lines while busy, graceful drain, engine stop).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import pathlib
from collections.abc import Callable

from rawserve.api import admin
from rawserve.api.access_log import logged, refusal_logger
from rawserve.api.body_gate import BodyGate
from rawserve.api.chat import create_chat_completion
from rawserve.api.completions import create_completion
from rawserve.api.embeddings import create_embeddings, pooling_only
from rawserve.api.guided import GrammarCache
from rawserve.api.media import ImageReader, MediaLimits
from rawserve.api.messages import (MESSAGES_PATH, anthropic_error_response, anthropic_errors, count_tokens,
                                   create_message)
from rawserve.api.rate_limit import RateLimiter
from rawserve.api.rerank import create_rerank
from rawserve.api.response_store import ResponseStore
from rawserve.api.responses import create_response, delete_response, list_input_items, retrieve_response
from rawserve.api.serving import ServingContext
from rawserve.api.status_log import StatsLogger, startup_summary
from rawserve.config import EngineConfig, ServerConfig
from rawserve.engine.frontend.async_llm import AsyncLLM
from rawserve.engine.launch import CoreFactory, kv_capacity
from rawserve.engine.pooling import PoolingSpec, read_pooling_spec
from rawserve.http import HTTPServer, Router, bind_socket
from rawserve.metrics import Metrics
from rawserve.text.chat_template import load_chat_template
from rawserve.text.defaults import GenerationDefaults, tool_call_parser_for
from rawserve.text.parsers import check_parser_names
from rawserve.text.tokenizer import Tokenizer

log = logging.getLogger("rawserve")


# What an embedding or rerank model answers with a 400 (it samples nothing), as vLLM's pooling runner does.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", MESSAGES_PATH)


def build_router(ctx: ServingContext, is_draining: Callable[[], bool], store: ResponseStore,
                 log_requests: bool = True, stall_timeout_s: float = 30.0,
                 pooling: PoolingSpec = PoolingSpec("generate")) -> Router:
    """Every route with its access line; routes under /v1 also carry a limited key's x-ratelimit-* headers."""
    router = Router()
    health = admin.health(ctx, stall_timeout_s)
    routes = [
        ("POST", "/v1/completions", functools.partial(create_completion, ctx)),
        ("POST", "/v1/chat/completions", functools.partial(create_chat_completion, ctx)),
        ("POST", "/v1/responses", functools.partial(create_response, ctx, store)),
        ("GET", "/v1/responses/{response_id}", functools.partial(retrieve_response, store)),
        ("DELETE", "/v1/responses/{response_id}", functools.partial(delete_response, store)),
        ("GET", "/v1/responses/{response_id}/input_items", functools.partial(list_input_items, store)),
        ("POST", MESSAGES_PATH, functools.partial(create_message, ctx)),
        ("POST", MESSAGES_PATH + "/count_tokens", functools.partial(count_tokens, ctx)),
        ("POST", "/v1/embeddings", functools.partial(create_embeddings, ctx, pooling)),
        ("POST", "/v1/rerank", functools.partial(create_rerank, ctx, pooling)),
        ("POST", "/rerank", functools.partial(create_rerank, ctx, pooling)),
        ("GET", "/v1/models", functools.partial(admin.list_models, ctx, task=pooling.task)),
        ("GET", "/v1/models/{model:path}", functools.partial(admin.retrieve_model, ctx, task=pooling.task)),
        ("POST", "/v1/load_lora_adapter", functools.partial(admin.load_lora_adapter, ctx)),
        ("POST", "/v1/unload_lora_adapter", functools.partial(admin.unload_lora_adapter, ctx)),
        ("GET", "/health", health),
        ("HEAD", "/health", health),  # load balancers probe with HEAD too; the same answer, without the body
        ("GET", "/ready", admin.ready(ctx, is_draining)),
        ("GET", "/metrics", functools.partial(admin.metrics, ctx)),
        ("GET", "/version", functools.partial(admin.version, ctx)),
        ("POST", "/tokenize", functools.partial(admin.tokenize, ctx)),
        ("POST", "/detokenize", functools.partial(admin.detokenize, ctx)),
        ("GET", "/tokenizer_info", functools.partial(admin.tokenizer_info, ctx)),
    ]
    gate = BodyGate()
    for method, path, handler in routes:
        if pooling.is_pooling and method == "POST" and path in GENERATION_PATHS:
            handler = pooling_only(pooling.task)
        if ctx.limiter is not None and ctx.limiter.is_enabled and path.startswith("/v1/"):
            handler = ctx.limiter.with_headers(handler)
        if method == "POST":  # a body of megabytes waits for one of a few slots before it is parsed
            handler = gate.wrap(handler)
        handler = logged(handler, log_requests)  # the access line; errors are logged either way
        if path.startswith(MESSAGES_PATH):  # Anthropic's API answers in Anthropic's error shape
            handler = anthropic_errors(handler)
        router.add(method, path, handler)
    router.set_error_shape(MESSAGES_PATH, anthropic_error_response)  # the HTTP layer's refusals (401, 405, 413...)
    return router


def generation_defaults(model_dir: pathlib.Path, tokenizer: Tokenizer, source: str) -> GenerationDefaults:
    """--generation-config: auto (the checkpoint's file), vllm (neutral sampling defaults) or a directory's
    generation_config.json. The EOS ids are the checkpoint's in every case: they say when its text ends."""
    own = GenerationDefaults.from_dir(model_dir, tokenizer)
    if source == "auto":
        return own
    if source == "vllm":
        return GenerationDefaults(eos_token_ids=own.eos_token_ids)
    return dataclasses.replace(GenerationDefaults.from_dir(source, tokenizer), eos_token_ids=own.eos_token_ids)


class OpenAIServer:
    """The whole server in one object: `await start()`, `.port`, `await serve()`, `await stop()`."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        if engine_config.model_dir is None:
            raise ValueError("--model-dir: the server needs a checkpoint directory")
        check_parser_names(server_config.reasoning_parser, server_config.tool_call_parser)
        self.engine_config = engine_config
        self.server_config = server_config
        model_dir = pathlib.Path(engine_config.model_dir)
        self.model_name = server_config.served_model_name or model_dir.resolve().name
        if self.model_name in engine_config.lora_paths():
            raise ValueError(f"--lora-modules: adapter name {self.model_name!r} is the served model's name")
        self.api_keys = server_config.api_keys()  # --api-key and --api-key-file, each with its tokens per minute
        # Without keys, --rate-limit-tpm is one bucket everyone shares.
        self.limiter = RateLimiter(self.api_keys if self.api_keys else {None: server_config.rate_limit_tpm})
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.chat_template = load_chat_template(model_dir, server_config.chat_template)
        self.defaults = generation_defaults(model_dir, self.tokenizer, server_config.generation_config)
        self.images = ImageReader.for_checkpoint(model_dir, self.tokenizer.token_to_id,
                                                 MediaLimits.from_config(server_config), self.model_name,
                                                 engine_config.mm_pixel_bounds())
        # generate, embed or rerank: which routes answer (the core reads the same files for how it pools)
        self.pooling = read_pooling_spec(model_dir, engine_config.runner, engine_config.pooling)
        # Named, not imported: the core (and torch) loads only in the core's thread or process.
        self.llm = AsyncLLM(CoreFactory(engine_config, server_config.log_level), self.tokenizer,
                            mode=server_config.engine_mode, max_pending=server_config.max_pending,
                            request_timeout_s=server_config.request_timeout_s,
                            metrics=Metrics(self.model_name, vllm_names=server_config.metrics_compat == "vllm"),
                            model_name=self.model_name)
        self.http: HTTPServer | None = None
        self.context: ServingContext | None = None
        self.responses = ResponseStore(server_config.responses_store_max)
        self._stats_task: asyncio.Task | None = None

    @property
    def port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def start(self) -> None:
        """Bind, then load the model (in the core) and serve; raises OSError at once if the port is taken,
        EngineDead if the core cannot start."""
        sock = bind_socket(self.server_config)  # before the model loads: a taken port fails in a moment
        # The HTTP layer checks every accepted key, the file's included.
        http_config = dataclasses.replace(self.server_config, api_key=list(self.api_keys))
        self.http = HTTPServer(http_config, admin.loading_router(),
                               on_refusal=refusal_logger(self.server_config.log_requests),
                               open_while_draining=admin.PROBE_PATHS)
        try:  # probes are answered while the model loads (/ready 503 loading), not left in the backlog
            await self.http.start(sock, announce=False)
        except BaseException:
            sock.close()
            raise
        try:
            await self.llm.start()
        except BaseException:
            await self.http.shutdown()
            raise
        info = self.llm.info or {}
        ctx = ServingContext(self.llm, self.tokenizer, self.model_name, info["max_model_len"],
                             info.get("vocab_size", self.tokenizer.vocab_size), self.defaults, self.chat_template,
                             self.server_config.reasoning_parser,
                             tool_call_parser_for(self.server_config.tool_call_parser, self.chat_template),
                             loras=dict(info.get("loras") or {}), limiter=self.limiter,
                             per_key_cache_salt=self.server_config.per_key_cache_salt,
                             kv_cache=kv_capacity(info), images=self.images,
                             grammars=GrammarCache(self.tokenizer,
                                                   compile_timeout_s=self.server_config.guided_compile_timeout_s,
                                                   num_workers=self.server_config.guided_compile_workers))
        self.context = ctx
        self.http.set_router(build_router(ctx, lambda: self.http.is_draining, self.responses,
                                          self.server_config.log_requests, self.server_config.engine_stall_timeout_s,
                                          self.pooling))
        log.info("%s", startup_summary(self.engine_config, self.server_config, self.model_name, info, self.port))
        self._stats_task = asyncio.get_running_loop().create_task(StatsLogger(self.llm).run())

    async def serve(self, install_signal_handlers: bool = True) -> int:
        """Serve until SIGTERM/SIGINT (or stop()); drain, stop the engine, return the exit status."""
        assert self.http is not None, "start() first"
        status = await self.http.serve_until_shutdown(install_signal_handlers)
        self._stop_stats()
        await self.llm.stop(0)
        self._close_grammars()
        return status

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.shutdown()
        self._stop_stats()
        await self.llm.stop(0)
        self._close_grammars()

    def _close_grammars(self) -> None:
        if self.context is not None:
            self.context.grammars.close()

    def _stop_stats(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            self._stats_task = None
