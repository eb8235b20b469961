"""The pooling models' routes: /v1/embeddings, /pooling, /score, /rerank and /classify (with
vLLM's /v1 and /v2 aliases)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.api_server.embedding_protocol import EmbeddingRequest, PoolingRequest
from jaxserve.api_server.route_utils import run_until_disconnected
from jaxserve.api_server.serving_embedding import OpenAIServingEmbedding
from jaxserve.api_server.serving_score import ServingScores


def pooling_router(embedding: OpenAIServingEmbedding, scores: ServingScores) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, embedding.create_embedding(body))

    @router.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw: Request) -> Response:
        return await run_until_disconnected(raw, embedding.create_embedding(body, pooling=True))

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, scores.score, methods=["POST"], response_model=None)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, scores.rerank, methods=["POST"], response_model=None)
    router.add_api_route("/classify", scores.classify, methods=["POST"], response_model=None)
    return router
