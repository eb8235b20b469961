"""vLLM's /score, /rerank (Jina's and Cohere's shapes) and /classify.

A sequence classifier (jaxserve/classifier.py) is a cross-encoder: each pair is one prompt,
tokenized as vLLM does (`tokenizer(a, text_pair=b)`, or the text a + b for an LLM made a
reranker), and its score is the classifier's one-label output. Any other model scores as an
embedding model: a pair's score is the cosine similarity of its two texts' embeddings. /classify
needs a classifier: each input's class probabilities and its most probable label.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from jaxserve.api_server.embedding_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from jaxserve.api_server.protocol import (
    INT32_MAX,
    Int64,
    NonEmptyText,
    OpenAIBaseModel,
    OpenAIRequest,
    Text,
    UsageInfo,
    WholeInt,
    random_uuid,
)
from jaxserve.api_server.serving import OpenAIError
from jaxserve.api_server.serving_embedding import OpenAIServingEmbedding

MAX_TEXTS = 2048  # as for embeddings
Texts = NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_TEXTS)]


class ScoreRequest(OpenAIRequest):
    model: Text | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=-1, le=INT32_MAX)] | None = None
    priority: Int64 = 0


class RerankRequest(OpenAIRequest):
    model: Text | None = None
    query: NonEmptyText
    documents: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_TEXTS)]
    top_n: Annotated[WholeInt, Field(ge=1, le=INT32_MAX)] | None = None  # None: every document
    truncate_prompt_tokens: Annotated[WholeInt, Field(ge=-1, le=INT32_MAX)] | None = None
    priority: Int64 = 0


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str | None = None
    multi_modal: list[dict[str, Any]] | None = None  # vLLM's; jaxserve reranks text only


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    """vLLM's rerank usage: the tokens scored, no completion or details."""

    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ServingScores:
    def __init__(self, embedding: OpenAIServingEmbedding) -> None:
        self.embedding = embedding
        self.ctx = embedding.ctx

    async def _scores(self, request_id: str, pairs: list[tuple[str, str]],
                      truncate: int | None, priority: int) -> tuple[list[float], int]:
        """Each pair's score, and the tokens it took: by the cross-encoder if the model is a
        classifier, else by cosines of embeddings."""
        head = self.ctx.processor.classifier
        if head is None:
            return await self._cosines(request_id, pairs, truncate, priority)
        received = time.time()
        keeping = truncate is not None
        ids = []
        for a, b in pairs:
            if head.use_sep_token:
                if not keeping:
                    self.ctx.check_text_size(b, "text_2")
                pair = await self.ctx.tokenize(a, "text_1", truncating=keeping, text_pair=b)
            else:
                pair = await self.ctx.tokenize(a + b, "text_1", truncating=keeping)
            ids.append(self.ctx.truncate(pair, truncate, None, room=1))
        outs = await self.embedding.embed(request_id, ids, received, priority=priority,
                                          param="text_1", task="score")
        return [float(o[0]) for o in outs], sum(len(i) for i in ids)

    async def _cosines(self, request_id: str, pairs: list[tuple[str, str]],
                       truncate: int | None, priority: int) -> tuple[list[float], int]:
        """Each pair's cosine similarity, and the tokens embedded (each distinct text once)."""
        received = time.time()
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        ids = [self.ctx.truncate(await self.ctx.tokenize(t, "text", truncating=truncate is not None),
                                 truncate, None, room=1) for t in texts]
        vectors = await self.embedding.embed(request_id, ids, received, normalize=False,
                                             priority=priority, param="text")
        unit = {t: np.asarray(v, np.float64) / max(float(np.linalg.norm(v)), 1e-12)
                for t, v in zip(texts, vectors)}
        return [float(unit[a] @ unit[b]) for a, b in pairs], sum(len(i) for i in ids)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """vLLM's pairing: one and one, one against each of many, or many against as many."""
        self.ctx.check_model(request.model)
        one = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        two = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if len(one) == 1:
            one = one * len(two)
        if len(one) != len(two):
            raise OpenAIError(f"text_1 has {len(one)} texts and text_2 {len(two)}: give one "
                              "text_1, or as many as text_2", param="text_1")
        request_id = f"score-{random_uuid()}"
        scores, tokens = await self._scores(request_id, list(zip(one, two)),
                                            request.truncate_prompt_tokens, request.priority)
        return ScoreResponse(id=request_id, model=self.ctx.model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, request: RerankRequest) -> RerankResponse:
        """The documents by relevance to the query, the most relevant first (top_n of them)."""
        self.ctx.check_model(request.model)
        request_id = f"rerank-{random_uuid()}"
        scores, tokens = await self._scores(
            request_id, [(request.query, d) for d in request.documents],
            request.truncate_prompt_tokens, request.priority)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:request.top_n]
        return RerankResponse(id=request_id, model=self.ctx.model_name,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=[RerankResult(index=i,
                                                    document=RerankDocument(text=request.documents[i]),
                                                    relevance_score=scores[i]) for i in order])

    async def classify(self, request: ClassificationRequest) -> ClassificationResponse:
        """Each input's class probabilities (logits with use_activation false) and label."""
        self.ctx.check_model(request.model)
        received = time.time()
        inputs = await self.embedding.inputs(request)
        request_id = f"classify-{random_uuid()}"
        outs = await self.embedding.embed(request_id, inputs, received, request.use_activation,
                                          priority=request.priority, task="classify")
        head = self.ctx.processor.classifier
        assert head is not None  # embed refused the task otherwise
        tokens = sum(len(i) for i in inputs)
        return ClassificationResponse(
            id=request_id, model=self.ctx.model_name,
            data=[ClassificationData(index=i, label=head.labels[int(np.argmax(p))], probs=p,
                                     num_classes=len(p)) for i, p in enumerate(outs)],
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
