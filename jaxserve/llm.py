"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`.

The engine core runs in this process with no sockets: the same scheduler,
worker and sampler as the server, so tests of `LLM` exercise the real path.
"""

from __future__ import annotations

import atexit
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.build import build_engine_core, run_follower_process
from jaxserve.engine.front_end import load_front_end
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.processor import POOLING_SAMPLING_PARAMS
from jaxserve.engine_core.request import Request
from jaxserve.outputs import EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]}


class LLM:
    """Generate offline with continuous batching; `model=None` is the default model."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`engine_args` are `EngineArgs`' fields (vLLM's names; an unknown one is a
        ValueError naming it)."""
        config = EngineArgs.from_kwargs(model=model, **engine_args).create_engine_config()
        dist = config.parallel_config.distributed()
        num_processes, process_id = dist.num_processes, dist.process_id
        if process_id != 0:
            # Multi-host, the same script on every host: the others follow process 0's steps
            # until its LLM shuts down, then leave; the rest of the script is process 0's.
            steps = run_follower_process(config)
            logging.getLogger(__name__).info("followed process 0 for %d steps", steps)
            raise SystemExit(0)
        self.front_end = load_front_end(config.model_config)
        self.tokenizer = self.front_end.tokenizer
        built = build_engine_core(config, self.front_end.eos_token_id)
        self.engine = built
        self.engine_core = built.core
        self.config = built.config
        self.output_processor = OutputProcessor(self.tokenizer, config.request_tracing)
        # The checks shared with the API server (jaxserve/engine/processor.py).
        self.processor = self.front_end.processor(
            built.resolved.max_model_len, built.worker.arch.vocab_size,
            self.config.pooler_config, classifier=built.resolved.classifier)
        self._counter = itertools.count()
        self._shut_down = False
        if num_processes > 1:
            atexit.register(self.shutdown)  # a script that ends still releases the others

    # ---- public API --------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's)."""
        # Any: generation_config.json's values, which SamplingParams validates.
        defaults: dict[str, Any] = dict(self.front_end.generation_defaults)
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries but there are {len(prompts)} prompts"
            )
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids.append(self._add_request(prompt, p, 0 if priority is None else priority[i]))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (vLLM's `LLM.embed`), pooled as `pooling_params` says
        (default: --pooler-config's pooling, normalized unless it says otherwise); by the
        same engine as `generate`, in input order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if pooling_params is None:
            pooling_params = self.processor.pooling_params()
        ids = [self._add_request(p, POOLING_SAMPLING_PARAMS, 0, pooling_params) for p in prompts]
        return self._run(ids, use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], *,
                 use_activation: bool = True, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """A sequence classifier's class probabilities per prompt (vLLM's `LLM.classify`;
        `outputs.probs`, or logits with use_activation false), in input order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = self.processor.pooling_params(use_activation, task="classify")
        ids = [self._add_request(p, POOLING_SAMPLING_PARAMS, 0, params) for p in prompts]
        return self._run(ids, use_tqdm)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """A cross-encoder's score of each pair (vLLM's `LLM.score`; `outputs.score`): one
        text against each of `data_2`, or pairs in order. The pair is tokenized as the
        server's /score does (jaxserve/classifier.py)."""
        one = [data_1] if isinstance(data_1, str) else list(data_1)
        two = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(one) == 1:
            one = one * len(two)
        if len(one) != len(two) or not two:
            raise ValueError(f"data_1 has {len(one)} texts and data_2 {len(two)}: give one "
                             "data_1, or as many as data_2")
        head = self.engine.resolved.classifier
        params = self.processor.pooling_params(task="score")  # refuses a model without a head
        assert head is not None and self.tokenizer is not None
        pairs = [self.tokenizer(a, text_pair=b) if head.use_sep_token else self.tokenizer(a + b)
                 for a, b in zip(one, two)]
        ids = [self._add_request({"prompt_token_ids": p.input_ids}, POOLING_SAMPLING_PARAMS, 0,
                                 params) for p in pairs]
        return self._run(ids, use_tqdm)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Release the other hosts of a multi-host engine (a no-op otherwise; once)."""
        if self._shut_down:
            return
        self._shut_down = True
        stop = getattr(self.engine_core.worker, "shutdown", None)
        if stop is not None:
            stop()

    # ---- internals ---------------------------------------------------------------------

    def _add_request(self, prompt: PromptType, params: SamplingParams, priority: int,
                     pooling_params: PoolingParams | None = None) -> str:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            token_ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        else:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (skip_tokenizer_init is set): "
                                 "give {'prompt_token_ids': [...]}")
            token_ids, text = self.tokenizer(prompt).input_ids, prompt
        if pooling_params is not None:
            self.processor.check_pooling_prompt(token_ids)
        else:
            self.processor.check_generates()
            self.processor.check_prompt(token_ids, None)  # offline, max_tokens caps at the context
        params = self.processor.check_params(params)
        request_id = str(next(self._counter))
        for cid, p in self.output_processor.add_request(request_id, text, token_ids, params,
                                                        pooling_params=pooling_params):
            self.engine_core.add_request(Request(cid, token_ids, p, self.front_end.eos_token_id, priority=priority,
                                                 pooling_params=pooling_params))
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        final: dict[str, Any] = {}
        core = self.engine_core
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while core.has_work():
                outputs = core.step_fn()
                if not outputs:
                    continue
                results, to_abort = self.output_processor.process_outputs(outputs)
                if to_abort:
                    core.abort_requests(to_abort)
                for r in results:
                    if r.finished:
                        final[r.request_id] = r
                        bar.update()
        return [final[i] for i in request_ids]
