"""POST /v1/rerank and /rerank in the Jina/Cohere shape: a query, documents (strings or {"text"}), top_n,
return_documents -> results sorted by relevance_score. A cross-encoder scores each (query, document) pair through its
tokenizer's pair template and classification head; Qwen3-Reranker, from P(yes) against P(no) after its prompt.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rawserve.api.embeddings import check_limits, run_pooling
from rawserve.api.serving import ServingContext
from rawserve.engine.pooling import (QWEN3_RERANK_INSTRUCTION, QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX,
                                     PoolingSpec)
from rawserve.engine.types import PoolingParams
from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, parse
from rawserve.text.tokenizer import RELEASE_GIL_AT

MAX_DOCUMENT_CHARS = 1 << 20  # one document's text; the body limit bounds the sum


@dataclass(slots=True)
class RerankRequest:
    query: str
    documents: list[str | dict[str, Any]]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    instruction: str | None = None  # Qwen3-Reranker's <Instruct> line (its default otherwise)
    priority: int = 0


def _texts(documents: list[str | dict[str, Any]]) -> list[str]:
    texts = []
    for k, doc in enumerate(documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise APIError(400, "A document is a string or an object with a string `text`.", param=f"documents.{k}")
        if len(text) > MAX_DOCUMENT_CHARS:
            raise APIError(400, f"A document is at most {MAX_DOCUMENT_CHARS} characters.", param=f"documents.{k}")
        texts.append(text)
    return texts


def _check_fits(ctx: ServingContext, ids: list[int], k: int) -> None:
    if len(ids) > ctx.max_model_len:
        raise APIError(400, f"This model's maximum context length is {ctx.max_model_len} tokens. However, the query "
                            f"with document {k} is {len(ids)} tokens.", param=f"documents.{k}",
                       code="context_length_exceeded")


def _pair_inputs(ctx: ServingContext, query: str, texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """A cross-encoder's inputs: each pair through the tokenizer's pair template, and where the document's
    segment (token type 1) starts (-1 when the template gives every token type 0, as XLM-R's does)."""
    prompts, splits = [], []
    for k, text in enumerate(texts):
        ids, types = ctx.tokenizer.encode_pair(query, text)
        _check_fits(ctx, ids, k)
        prompts.append(ids)
        splits.append(types.index(1) if 1 in types else -1)
    return prompts, splits


def _yes_no_inputs(ctx: ServingContext, query: str, texts: list[str], instruction: str) -> list[list[int]]:
    """Qwen3-Reranker's inputs: prefix, the instruction, query and document, suffix; the three parts tokenized
    apart and joined, as its model card does."""
    tok = ctx.tokenizer
    prefix = tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    prompts = []
    for k, text in enumerate(texts):
        body = tok.encode(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {text}", add_special_tokens=False)
        ids = prefix + body + suffix
        _check_fits(ctx, ids, k)
        prompts.append(ids)
    return prompts


def yes_no_ids(ctx: ServingContext) -> tuple[int, int]:
    yes, no = ctx.tokenizer.token_to_id("yes"), ctx.tokenizer.token_to_id("no")
    if yes is None or no is None:
        raise APIError(400, "This model's tokenizer has no `yes` and `no` tokens to score with.",
                       code="unsupported_task")
    return yes, no


def _score(spec: PoolingSpec, vector: list[float]) -> float:
    if spec.scorer == "yes_no":  # softmax over (yes, no): the probability of yes
        yes, no = vector
        return 1.0 / (1.0 + math.exp(min(no - yes, 700.0)))
    logit = vector[0]
    return 1.0 / (1.0 + math.exp(min(-logit, 700.0))) if spec.sigmoid else logit


async def create_rerank(ctx: ServingContext, spec: PoolingSpec, request: Request) -> JSONResponse:
    if spec.task != "rerank":
        raise APIError(400, f"The model does not support {request.path}: it is served for {spec.task}.",
                       code="unsupported_task")
    started = time.monotonic()
    req = parse(RerankRequest, request.json())
    ctx.check_model(req.model)
    caller = ctx.caller(request)
    if not req.query:
        raise APIError(400, "query is empty.", param="query")
    if not req.documents:
        raise APIError(400, "documents is empty.", param="documents")
    if req.top_n is not None and req.top_n < 1:
        raise APIError(400, f"top_n must be a positive integer, got {req.top_n}.", param="top_n")
    check_limits(len(req.documents), 0, "documents")
    texts = _texts(req.documents)
    big = sum(map(len, texts)) + len(req.query) * len(texts) > RELEASE_GIL_AT
    if spec.scorer == "yes_no":
        ids = yes_no_ids(ctx)
        instruction = req.instruction or QWEN3_RERANK_INSTRUCTION
        build = lambda: (_yes_no_inputs(ctx, req.query, texts, instruction), [-1] * len(texts))  # noqa: E731
        pooling = [PoolingParams("last", logit_ids=ids)] * len(texts)
    else:
        build = lambda: _pair_inputs(ctx, req.query, texts)  # noqa: E731
        pooling = None
    prompts, splits = await asyncio.to_thread(build) if big else build()  # long inputs off the event loop
    if pooling is None:
        pooling = [PoolingParams("cls", type_split=split) for split in splits]
    num_tokens = sum(map(len, prompts))
    check_limits(len(prompts), num_tokens, "documents")
    rid = f"rerank-{uuid.uuid4().hex}"
    vectors = await run_pooling(ctx, prompts, pooling, rid, caller, req.priority)
    scores = [_score(spec, v) for v in vectors]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or len(scores)]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    metrics = ctx.llm.metrics
    metrics.inc("pooling_requests_total", label_value="rerank")
    metrics.inc("pooling_inputs_total", len(prompts), label_value="rerank")
    metrics.observe("pooling_request_latency_seconds", time.monotonic() - started)
    return JSONResponse({"id": rid, "model": ctx.model_name, "results": results,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
