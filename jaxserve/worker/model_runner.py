"""ModelRunner: SchedulerOutput -> padded device inputs -> compiled step -> tokens.

Two compiled programs per step (one forward per pipeline stage), each bucketed
on one axis so their count stays small (|token buckets| + 3 x |request buckets|,
all compiled at warm-up):

    forward[T]        (ForwardKey, params, kv_cache*, last_sampled, packed inputs)
                      -> kv_cache, hidden[S]
                      runs the decoder over T (padded) tokens and keeps the hidden
                      state of each request's last token only
    sample[R, mode, verify]
                      (SamplerKey, params, hidden[P], last_sampled*, penalty state*,
                       packed sampling md)
                      -> last_sampled, penalty state, tokens[R] and their logprobs
                      LM head on R (padded) rows only, then the on-device Sampler in the
                      batch's SamplerMode (greedy / random / filtered: no device branch);
                      verify: the rejection sampler over draft rows (speculative decoding)

(* donated: updated in place.) Each program's per-step inputs travel as one packed
int32 buffer (packing.py): one upload per program per step. The sampled tokens stay on
the device in `last_sampled[slot]`, where the next step's forward reads them, so the host
can prepare step N+1 before step N's tokens come back (async scheduling). Without async
scheduling's placeholders the batch also keeps them once they are back, and a step whose
tokens are all known does not wait for the previous step's sampler (pipeline microbatches).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, ParamSpec, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.models import AttentionMetadata
from jaxserve.models.variables import model_variables
from jaxserve.parallel.pipeline import Stage
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.worker.buckets import (
    MIN_TOKEN_BUCKET,
    pad_to_bucket,
    request_buckets,
    token_buckets,
    verify_buckets,
)
from jaxserve.worker.compile_progress import CompileProgress
from jaxserve.worker.input_batch import InputBatch, StepInputs, as_dict
from jaxserve.worker.packing import Packing
from jaxserve.worker.penalty_state import LogitsProcessors, PenaltyState, admit, admit_inputs, after_sampling
from jaxserve.worker.pooler import Pooler, pool_sums
from jaxserve.worker.programs import ForwardKey, Program, ProgramKind, SamplerKey, TokensKey
from jaxserve.worker.programs import abstract as abstract_tree
from jaxserve.worker.rejection_sampler import rejection_sample
from jaxserve.worker.sampler import (
    DEFAULT_SEARCH,
    SamplerMode,
    SamplerOutput,
    SamplingMetadata,
    ThresholdSearch,
    sample,
)
from jaxserve.worker.sampler_inputs import grammar_bitmask, sampler_packing, sampling_inputs, verify_inputs
from jaxserve.worker.step_handle import (
    CompileMonitor,
    PoolOut,
    PreparedStep,
    PromptLogprobRows,
    PromptLogprobsOut,
    PromptLogprobTargets,
    StepFacts,
    StepHandle,
    host_array,
    prompt_logprobs_output,
    sampled_output,
)

if TYPE_CHECKING:
    from jaxserve.models import DecoderModel

logger = logging.getLogger(__name__)

# A stage's weights: Flax variables, nested as the model's modules are (no finer type).
Params = dict[str, Any]
# A decoder's run_layers: (module, hidden, positions, its cache, metadata) -> (hidden, cache).
RunLayers = Callable[[Any, jax.Array, jax.Array, Any, AttentionMetadata], tuple[jax.Array, Any]]
_P = ParamSpec("_P")
_R = TypeVar("_R")


def model_apply(model: DecoderModel, params: Params,
          method: Callable[Concatenate[Any, _P], _R], *args: _P.args,
          **kwargs: _P.kwargs) -> _R:
    """`model.apply(params, *args, method=method)`, typed as `method` returns (Flax types
    `apply` for mutable collections too)."""
    return cast(_R, model.apply(params, *args, method=method, **cast(dict[str, Any], kwargs)))


class FinalStates(NamedTuple):
    """The last stage's output: the final-norm states of the sampled rows, and with
    `ForwardKey.all_rows` those of every token (prompt logprobs, pooling)."""

    rows: jax.Array  # [num_logit_rows, H]
    every_token: jax.Array | None  # [T, H]


class ForwardOut(NamedTuple):
    """A dispatched forward's device outputs: the sampled rows' states (the sampler's input)
    and the step's prompt logprobs and pooled sums, when it has such requests."""

    hidden: jax.Array
    prompt_out: PromptLogprobsOut | None
    pool_out: PoolOut | None


def request_seed(engine_seed: int, req_id: str) -> int:
    """The sampling seed of a request that brings none: a hash of the engine seed and the
    request id, the same in every process and every run (Python's hash() is salted per
    process, which made multi-host processes sample different tokens)."""
    digest = hashlib.blake2b(f"{engine_seed}:{req_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class ModelRunner:
    def __init__(
        self,
        stages: list[Stage],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        min_token_bucket: int = MIN_TOKEN_BUCKET,
        seed: int = 0,
        max_verify_rows: int = 0,
        record_sampled: bool = True,
        abstract: bool = False,
        logprobs_branch: bool = False,
        threshold_search: ThresholdSearch = DEFAULT_SEARCH,
        pooler: Pooler | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`max_verify_rows` > 0 turns on draft verification (speculative decoding): the
        most logits rows a step with drafts has (requests plus their drafts).
        `record_sampled`: keep sampled tokens in the input batch once a step's result is
        read (steps whose tokens are all known then do not wait for the previous sampler).
        `abstract`: allocate nothing; the device state is ShapeDtypeStructs, for compiling
        `programs()` on devices this process may not have (preflight, KV-cache sizing).
        `logprobs_branch`: a step where no row asks for logprobs skips their passes over the
        vocabulary, by a data-dependent branch on the device: for the CPU only (on GPU/TPU
        such a branch can synchronise with the host; scripts/export_step.py refuses it).
        `threshold_search`: how top-k and top-p find their thresholds (sampler.ThresholdSearch).
        `pooler`: the pooling requests' (worker/pooler.py; a classifier's holds its head).
        `compiler_options`: XLA's, for every program this runner dispatches (worker.py)."""
        self.stages = stages
        self.logprobs_branch = logprobs_branch
        self.threshold_search = threshold_search
        last = stages[-1]
        self.model = last.model  # the LM head and sampler run on the last stage
        self.params = last.params
        replicated = last.replicated
        self.max_num_seqs = S = max_num_seqs
        self.token_buckets = token_buckets(max_num_batched_tokens, min_token_bucket)
        self.request_buckets = request_buckets(max_num_seqs)
        V = self.model.cfg.vocab_size
        self.max_verify_rows = max_verify_rows
        self.record_sampled = record_sampled
        # Rows of final states the forward keeps: one per request, or per draft row.
        self.num_logit_rows = max(S, max_verify_rows)
        self.verify_buckets = verify_buckets(max_verify_rows) if max_verify_rows else ()
        self.batch = InputBatch(S, max_model_len, block_size, V, self.num_logit_rows,
                                len(self.model.opts.kv_cache_groups.groups))
        self.seed = seed
        self._num_requests_seen = 0
        # Committed to the mesh from the start: warm-up and serving must see the same
        # argument shardings, or the first real step would compile again.
        # (From NumPy: across hosts, device_put takes host data, not another device's array.)
        place = (lambda x, s: abstract_tree(x, s)) if abstract else jax.device_put
        self.last_sampled = place(np.zeros((S,), np.int32), replicated)
        # Stage 0's input when every token of a step is known on the host: not the previous
        # step's last_sampled, so it need not wait for that step's sampler.
        self._no_sampled = place(np.zeros((S,), np.int32), replicated)
        # Tests and tools: called as (step, stage index, stage output) after each dispatch.
        self.stage_observer: Callable[[int, int, jax.Array | FinalStates], None] | None = None
        self._num_steps = 0
        self.penalties = place(PenaltyState.zeros(S, V), replicated)
        # The compiled programs (public: worker/programs.py lists them for the warm-up, the
        # KV-cache sizing and the preflight; `*_fn` are their traced functions).
        options = dict(compiler_options) if compiler_options else None
        self.stage_program = _jit_method(self, ModelRunner.stage_fn, static_argnums=(0,),
                                         donate_argnums=(2,), compiler_options=options)
        self.prompt_logprobs_program = _jit_method(self, ModelRunner.prompt_logprobs_fn,
                                                   out_shardings=replicated, compiler_options=options)
        self.pooler = pooler or Pooler(S)
        self.pool_program = jax.jit(pool_sums, static_argnums=(2,), out_shardings=replicated,
                                    compiler_options=options)
        # Sampler results are replicated so every process (multi-host) holds them whole.
        self.sample_program = _jit_method(self, ModelRunner.sample_fn, static_argnums=(0,),
                                          donate_argnums=(3, 4), out_shardings=replicated,
                                          compiler_options=options)
        self.admit_program = jax.jit(admit, donate_argnums=(0,), compiler_options=options)
        # Device seconds of each sampler program, timed at warm-up: traces split a step's
        # device time into forward and sampler with it.
        self.sample_time_s: dict[SamplerKey, float] = {}
        CompileMonitor.install()

    # ---- compiled programs -------------------------------------------------------------

    def forward_packing(self, num_tokens: int) -> Packing:
        return StepInputs.packing(num_tokens, self.max_num_seqs, self.batch.max_pages,
                                  self.num_logit_rows, self.batch.num_groups)

    def stage_fn(self, key: ForwardKey, params: Params, kv_cache: Any, x: jax.Array,
                 buf: jax.Array) -> tuple[Any, jax.Array | FinalStates]:
        """One pipeline stage (the whole model when pp = 1) over a `key.tokens` bucket.

        The first stage embeds (x = last_sampled: tokens sampled by the previous step
        have not reached the host, so they are read here); the others continue from
        the hidden states x. The last stage keeps each request's last hidden state.
        """
        inp: StepInputs[jax.Array] = StepInputs(**self.forward_packing(key.tokens).unpack(buf))
        st = self.stages[key.stage]
        params = model_variables(params)  # int8 layer weights: a collection of their own
        if st.is_first:
            input_ids = jnp.where(inp.prev_slot >= 0, x[jnp.maximum(inp.prev_slot, 0)], inp.input_ids)
            x = model_apply(st.model, params, type(st.model).embed, input_ids)
        md = AttentionMetadata(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
        # Each decoder's own cache type (an array, or a hybrid's HybridCache): one signature here.
        run_layers = cast(RunLayers, type(st.model).run_layers)
        h, kv_cache = model_apply(st.model, params, run_layers, x, inp.positions, kv_cache, md)
        if not st.is_last:
            return kv_cache, h
        # A fixed number of rows, so the sampler's shapes do not depend on T.
        rows = jnp.pad(inp.logits_indices, (0, self.num_logit_rows - inp.logits_indices.shape[0]))
        normed = model_apply(st.model, params, type(st.model).final_norm, h)
        # all_rows (prompt logprobs): every token's state too, not only the sampled rows.
        return kv_cache, FinalStates(normed[rows], normed if key.all_rows else None)

    def _forward(self, inp: StepInputs[np.ndarray], all_rows: bool = False) -> FinalStates:
        """Run every stage; activations hop to the next stage's devices asynchronously.
        Returns the sampled rows' final states, and with `all_rows` every token's too."""
        T = inp.input_ids.shape[0]
        buf = self.forward_packing(T).pack(as_dict(inp))
        x: jax.Array | FinalStates = self.last_sampled if (inp.prev_slot >= 0).any() else self._no_sampled
        self._num_steps += 1
        for st in self.stages:
            if len(self.stages) > 1:
                x = jax.device_put(x, st.replicated)
            st.kv_cache, x = self.stage_program(ForwardKey(st.index, T, all_rows and st.is_last),
                                                st.params, st.kv_cache, x,
                                                jax.device_put(buf, st.replicated))
            if self.stage_observer is not None:
                self.stage_observer(self._num_steps, st.index, x)
        return cast(FinalStates, x)  # the last stage's

    def prompt_logprobs_fn(self, params: Params, hidden: jax.Array, targets: jax.Array
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per token row: the logprob of `targets` (the next prompt token), then the top-N,
        and the target's rank; from the raw model distribution, as sampled logprobs.
        (token ids, logprobs, ranks): PromptLogprobsOut's fields."""
        logits = model_apply(self.model, params, type(self.model).compute_logits, hidden)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top_v, top_i = jax.lax.top_k(lp, MAX_LOGPROBS)
        target_lp = jnp.take_along_axis(lp, targets[:, None], axis=-1)
        ranks = 1 + jnp.sum(lp > target_lp, axis=-1).astype(jnp.int32)
        return (jnp.concatenate([targets[:, None], top_i.astype(jnp.int32)], axis=-1),
                jnp.concatenate([target_lp, top_v], axis=-1), ranks)

    def _prompt_rows(self, req_ids: list[str], slots: np.ndarray, inp: StepInputs[np.ndarray],
                     T: int) -> PromptLogprobTargets | None:
        """The step's token rows that are prompt positions of prompt_logprobs requests (each
        predicting the next prompt token), or None when no request needs any."""
        b = self.batch
        wanted = np.flatnonzero(b.prompt_logprobs[slots] >= 0)
        if not len(wanted):
            return None
        targets = np.zeros(T, np.int32)
        rows: list[PromptLogprobRows] = []
        for i in wanted.tolist():
            slot, end = int(slots[i]), int(inp.kv_lens[i])
            start_tok, count = int(inp.cu_q_lens[i]), int(inp.cu_q_lens[i + 1] - inp.cu_q_lens[i])
            first = end - count  # this chunk's first position
            last = min(end, int(b.num_prompt_tokens[slot]) - 1)  # the last position predicts an output
            if last <= first:
                continue
            n = last - first
            targets[start_tok:start_tok + n] = b.token_ids[slot, first + 1:last + 1]
            rows.append(PromptLogprobRows(req_ids[i], first, start_tok, n,
                                          int(b.prompt_logprobs[slot])))
        return PromptLogprobTargets(targets, rows) if rows else None

    def sample_fn(self, key: SamplerKey, params: Params, hidden: jax.Array,
                  last_sampled: jax.Array, penalties: PenaltyState, buf: jax.Array,
                  bitmask: jax.Array | None = None
                  ) -> tuple[jax.Array, PenaltyState, SamplerOutput]:
        """`key.processors`: some row has a penalty or logits processor (needs_processors); else
        no per-slot [vocab] state is read or updated."""
        u = sampler_packing(key.rows, key.verify).unpack(buf)
        slots, real = u.pop("slots"), u.pop("real")
        drafts = (u.pop("draft_ids"), u.pop("group_first")) if key.verify else None
        wanted = u.pop("logprobs")
        md = SamplingMetadata(**u, logprobs=wanted if self.logprobs_branch else None)
        # An identity barrier: XLA's Triton GEMM emitter fails on a one-row slice fused into
        # the LM head (R = 1 on H100/H200: "Reshape input and output shapes must be the same")
        sampled_rows = jax.lax.optimization_barrier(hidden[:key.rows])
        logits = model_apply(self.model, params, type(self.model).compute_logits, sampled_rows)
        rows = jnp.minimum(slots, self.max_num_seqs - 1)
        prompt_mask: jax.Array | None = None
        output_counts: jax.Array | None = None
        processors: LogitsProcessors | None = None
        if key.processors:
            prompt_mask, output_counts = penalties.prompt_mask[rows], penalties.output_counts[rows]
            processors = penalties.processors(rows, bitmask)
        if drafts is not None:
            draft_ids, group_first = drafts
            out = rejection_sample(logits, prompt_mask, output_counts, md, key.mode, processors,
                                   draft_ids, group_first, self.threshold_search)
        else:
            out = sample(logits, prompt_mask, output_counts, md, key.mode, processors,
                         self.threshold_search)
        # Padding rows carry slot S (out of range): mode="drop" discards their writes.
        S = self.max_num_seqs
        if not key.verify:
            last_sampled = last_sampled.at[slots].set(out.sampled, mode="drop")
            if key.processors:
                penalties = after_sampling(penalties, slots, rows, out.sampled, real, real)
            return last_sampled, penalties, out
        assert out.emitted is not None and out.final is not None  # the rejection sampler's
        last_sampled = last_sampled.at[jnp.where(out.final, slots, S)].set(out.sampled, mode="drop")
        if key.processors:  # one token a step per request: in a verification step, its final one
            penalties = after_sampling(penalties, slots, rows, out.sampled, real & out.emitted,
                                       real & out.final)
        return last_sampled, penalties, out

    # ---- per step ----------------------------------------------------------------------

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Update the batch from `so`, dispatch the step and return without waiting."""
        compiles, compile_s = CompileMonitor.count, CompileMonitor.seconds
        self._update_batch(so)
        step = self._prepare(so)
        if step is None:
            return StepHandle(self, None)
        fwd = self._run_forward(step)
        bitmask = grammar_bitmask(so.grammar_bitmask, step.req_ids, step.per_req, step.R,
                                  self.model.cfg.vocab_size)
        key = SamplerKey(step.R, step.sampler.mode, step.verify, step.sampler.processors)
        out = self._run_sampler(step, key, fwd.hidden, bitmask)
        # A grammar's variant is not timed at warm-up: its step reports the variant's without.
        facts = StepFacts(self.sample_time_s.get(key, 0.0),
                          CompileMonitor.count - compiles, CompileMonitor.seconds - compile_s)
        first_positions = None
        if self.record_sampled:
            n, per_req = len(step.req_ids), step.per_req
            first_positions = step.inp.kv_lens[:n] - (0 if per_req is None else per_req - 1)
        return StepHandle(self, step, out=out, num_logprobs=self.batch.num_logprobs[step.slots].copy(),
                          prompt_out=fwd.prompt_out, pool_out=fwd.pool_out, facts=facts,
                          first_positions=first_positions)

    def _prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        """The step's padded inputs, its buckets and its sampler inputs (None: nothing runs)."""
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return None
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int32, len(req_ids))
        T = pad_to_bucket(int(num_sched.sum()), self.token_buckets)
        spec = so.scheduled_spec_decode_tokens
        per_req = None  # logits rows per request: 1, or 1 + its drafts
        if spec:
            num_drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int32, len(req_ids))
            drafts = [t for r in req_ids for t in spec.get(r, ())]
            inp, slots, samples = self.batch.prepare(req_ids, num_sched, T, num_drafts, drafts)
            per_req = num_drafts + 1
            R = pad_to_bucket(int(per_req.sum()), self.verify_buckets)
            sampler = verify_inputs(self.batch, inp, slots, samples, num_drafts, drafts, R)
        else:
            inp, slots, samples = self.batch.prepare(req_ids, num_sched, T)
            R = pad_to_bucket(len(req_ids), self.request_buckets)
            sampler = sampling_inputs(self.batch, slots, samples, inp.kv_lens[: len(req_ids)], R)
        pool = self.pooler.segments(req_ids, inp.kv_lens, inp.cu_q_lens,
                                    self.batch.num_prompt_tokens[slots], T)
        return PreparedStep(req_ids, inp, slots, samples, T, R, sampler, per_req,
                            self._prompt_rows(req_ids, slots, inp, T), pool)

    def _run_forward(self, step: PreparedStep) -> ForwardOut:
        """Dispatch the forward, and the prompt-logprobs and pooling programs on its every-token
        states when the step has such requests."""
        states = self._forward(step.inp, all_rows=step.prompt is not None or step.pool is not None)
        every_token = states.every_token
        if every_token is None:
            return ForwardOut(states.rows, None, None)
        # Compiled on first use (rare request kinds; warm-up does not cover them).
        prompt_out: PromptLogprobsOut | None = None
        pool_out: PoolOut | None = None
        if step.prompt is not None:
            ids, lps, ranks = self.prompt_logprobs_program(self.params, every_token,
                                                           step.prompt.targets)
            prompt_out = PromptLogprobsOut(ids, lps, ranks, step.prompt.rows)
        if step.pool is not None:
            rows = step.pool.rows
            pool_out = PoolOut(self.pool_program(every_token, step.pool.segments, self.max_num_seqs),
                               rows, every_token if Pooler.wants_rows(rows) else None)
        return ForwardOut(states.rows, prompt_out, pool_out)

    def _run_sampler(self, step: PreparedStep, key: SamplerKey, hidden: jax.Array,
                     bitmask: np.ndarray | None) -> SamplerOutput:
        """Dispatch the sampler (or the verification sampler) `key` names, or its grammar
        variant with a bitmask; its device outputs."""
        # NOTE: no bitmask argument at all without one: an explicit None would be another
        # call signature to jit, and compile again what warm-up compiled. With one, the
        # program variant is compiled on first use, like prompt logprobs.
        # A grammar's bitmask is one of the logits processors.
        if bitmask is not None:
            key = dataclasses.replace(key, processors=True, grammar=True)
        self.last_sampled, self.penalties, out = self.sample_program(
            key, self.params, hidden, self.last_sampled, self.penalties, step.sampler.packed,
            *(() if bitmask is None else (bitmask,)))
        return out

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    def _update_batch(self, so: SchedulerOutput) -> None:
        # Sorted: a set's order follows Python's per-process hash salt, and the order slots
        # are freed in decides where the next requests land; every process of a multi-host
        # engine must place them alike.
        for req_id in sorted(so.finished_req_ids | so.preempted_req_ids):
            self.batch.remove_request(req_id)
            self.pooler.remove_request(req_id)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            slot = self.batch.req_id_to_slot[req_id]
            self.batch.append_blocks(slot, new_blocks)
            self.batch.num_computed_tokens[slot] = computed
        for new in so.scheduled_new_reqs:
            p = new.sampling_params
            seed = p.seed if p.seed is not None else request_seed(self.seed, new.req_id)
            token_ids = [*new.prompt_token_ids, *new.output_token_ids]
            slot = self.batch.add_request(
                new.req_id, token_ids, p, new.block_ids, new.num_computed_tokens, seed,
                num_prompt_tokens=len(new.prompt_token_ids),
            )
            if new.pooling_params is not None:
                self.pooler.add_request(new.req_id, new.pooling_params)
            stop = p.all_stop_token_ids(new.eos_token_id) if p.min_tokens else ()
            # SamplingParams declares these as a user gives them; its __post_init__ stores
            # tuples: (token id, bias) pairs and token id sequences.
            self._admit_slot(slot, new.prompt_token_ids, new.output_token_ids, stop,
                             cast(tuple[tuple[int, float], ...], p.logit_bias), p.allowed_token_ids,
                             cast(tuple[tuple[int, ...], ...], p.bad_words_token_ids))

    def _admit_slot(self, slot: int, prompt: list[int], outputs: list[int],
                    stop_ids: Collection[int] = (), logit_bias: tuple[tuple[int, float], ...] = (),
                    allowed_token_ids: Sequence[int] | None = None,
                    bad_words_token_ids: Sequence[Sequence[int]] = ()) -> None:
        """Reset `slot`'s sampler state for a request (admit_inputs' arguments)."""
        arrays = admit_inputs(self.batch.max_model_len, self.model.cfg.vocab_size, prompt,
                              outputs, stop_ids, logit_bias, allowed_token_ids, bad_words_token_ids)
        self.penalties = self.admit_program(self.penalties, np.int32(slot), *arrays)

    def read_output(self, handle: StepHandle) -> ModelRunnerOutput:
        """A dispatched step's tokens, logprobs and trace facts on the host: the step's device
        sync (the bench and `StageTimeline` wrap it to time and order the reads)."""
        step, out = handle.step, handle.out
        if step is None or out is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        assert handle.num_logprobs is not None  # set with `out`
        result = sampled_output(step, out, handle.num_logprobs)
        if handle.first_positions is not None:
            self.batch.record_sampled(step.req_ids, step.slots, handle.first_positions,
                                      result.sampled_token_ids)
        if handle.prompt_out is not None:
            result.prompt_logprobs = prompt_logprobs_output(handle.prompt_out)
        if (pool := handle.pool_out) is not None:
            result.pooler_output = self.pooler.finish(host_array(pool.sums), pool.rows,
                                                      pool.every_token)
        f = handle.facts
        result.sample_s, result.num_compiles, result.compile_s = f.sample_s, f.num_compiles, f.compile_s
        return result

    # ---- warm-up -----------------------------------------------------------------------

    def state_bytes(self) -> tuple[Any, ...]:
        """The runner's own device state besides weights and cache (for KV-cache sizing): a
        pytree of arrays, or of ShapeDtypeStructs in an abstract runner (hence Any)."""
        return (self.last_sampled, self._no_sampled, self.penalties)

    def programs(self, on_first_use: bool = True) -> list[Program]:
        """Every program the engine runs, with abstract arguments on this runner's meshes (the
        KV caches and the runner's state are whatever it holds: arrays, or abstract), in the
        order `warm_up` compiles them, then (`on_first_use`) the variants compiled when a
        request first needs them (prompt logprobs, pooling, a grammar bitmask). See
        worker/programs.py."""
        H, dtype = self.model.cfg.hidden_size, self.model.opts.dtype

        def i32(shape: tuple[int, ...], mesh: Mesh) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

        out: list[Program] = []
        for T in self.token_buckets:
            for all_rows in (False, True) if on_first_use else (False,):
                x = self.last_sampled
                for st in self.stages:
                    if st.index > 0:
                        x = jax.ShapeDtypeStruct((T, H), dtype, sharding=st.replicated)
                    name = f"forward[T={T}" + (f", stage {st.index}" if len(self.stages) > 1 else "")
                    if all_rows:
                        if not st.is_last:
                            continue
                        name += ", every token"
                    fkey = ForwardKey(st.index, T, all_rows)
                    buf = i32((self.forward_packing(T).size,), st.mesh)
                    out.append(Program(name + "]", ProgramKind.FORWARD, self.stage_program,
                                       (fkey, st.params, st.kv_cache, x, buf), st.mesh,
                                       cache_arg=2, at_warm_up=not all_rows, key=fkey))
        last = self.stages[-1]
        hidden = jax.ShapeDtypeStruct((self.num_logit_rows, H), dtype, sharding=last.replicated)
        words = -(-self.model.cfg.vocab_size // 32)
        # The request buckets, then the verification sampler's row buckets (speculative decoding).
        buckets = [(R, False) for R in self.request_buckets] + [(R, True) for R in self.verify_buckets]
        for R, verify in buckets:
            kind = ProgramKind.VERIFY if verify else ProgramKind.SAMPLE
            buf = i32((sampler_packing(R, verify).size,), last.mesh)
            # Each mode without and with the penalties and logits processors (a step where no row
            # has one skips their [rows, vocab] passes); a grammar's variant compiles on first use.
            variants = ((False, False), (True, False), (True, True))[:3 if on_first_use else 2]
            for mode in SamplerMode:
                for processors, grammar in variants:
                    skey = SamplerKey(R, mode, verify, processors, grammar)
                    extra = (i32((R, words), last.mesh),) if grammar else ()
                    tag = ", grammar" if grammar else ", processors" if processors else ""
                    out.append(Program(f"{kind}[R={R}, {mode.value}{tag}]", kind, self.sample_program,
                                       (skey, self.params, hidden, self.last_sampled, self.penalties,
                                        buf, *extra), last.mesh, at_warm_up=not grammar, key=skey))
        if on_first_use:
            for T in self.token_buckets:
                every = jax.ShapeDtypeStruct((T, H), dtype, sharding=last.replicated)
                out.append(Program(f"prompt_logprobs[T={T}]", ProgramKind.PROMPT_LOGPROBS,
                                   self.prompt_logprobs_program,
                                   (self.params, every, i32((T,), last.mesh)), last.mesh,
                                   at_warm_up=False, key=TokensKey(T)))
                out.append(Program(f"pool[T={T}]", ProgramKind.POOL, self.pool_program,
                                   (every, i32((T,), last.mesh), self.max_num_seqs), last.mesh,
                                   at_warm_up=False, key=TokensKey(T)))
        arrays = admit_inputs(self.batch.max_model_len, self.model.cfg.vocab_size, [], [])
        out.append(Program("admit", ProgramKind.ADMIT, self.admit_program,
                           (self.penalties, i32((), last.mesh),
                            *(abstract_tree(a, last.replicated) for a in arrays)), last.mesh))
        return out

    # ---- warm-up -----------------------------------------------------------------------

    def _warm_up_sampler(self, key: SamplerKey, inp: StepInputs[np.ndarray],
                         hidden: jax.Array) -> None:
        """Compile one sampler program on no rows, then time a warm run of it."""
        empty, no_mask = np.zeros(0, np.int32), np.zeros(0, bool)
        md = (verify_inputs(self.batch, inp, empty, no_mask, empty, [], key.rows) if key.verify
              else sampling_inputs(self.batch, empty, no_mask, empty, key.rows)).packed
        for timed in (False, True):
            jax.block_until_ready(hidden)
            t = time.perf_counter()
            self.last_sampled, self.penalties, out = self.sample_program(
                key, self.params, hidden, self.last_sampled, self.penalties, md)
            jax.block_until_ready(out)
            if timed:
                self.sample_time_s[key] = time.perf_counter() - t

    def warm_up(self, show_progress: bool | None = None) -> float:
        """Compile and run once every program `programs(on_first_use=False)` lists, so nothing
        compiles while serving: each forward token bucket (all its stages in one pass), each
        (request bucket, sampler mode, with and without processors) and the admission.

        Runs each on empty inputs (no sequences: attention loops zero times, writes land in the
        null page, samples on dropped slots), built from the program's key: only a call, not
        `lower().compile()`, fills jit's dispatch cache. Shows the programs compiled so far
        (worker/compile_progress.py) when `show_progress` (default: on JAX process 0 only, as
        vLLM shows its CUDA graph capture on the first rank). Returns the seconds spent."""
        t0 = time.perf_counter()
        programs = self.programs(on_first_use=False)
        empty = np.zeros(0, np.int32)
        inp: StepInputs[np.ndarray] | None = None
        hidden: jax.Array | None = None
        if show_progress is None:
            show_progress = jax.process_index() == 0
        with CompileProgress(len(programs), show=show_progress) as progress:
            for p in programs:
                key = p.key
                with progress.compiling(p.name):
                    if isinstance(key, ForwardKey):
                        if key.stage == 0:  # the first stage's program: one pass runs every stage
                            inp = self.batch.prepare([], empty, key.tokens)[0]
                            hidden = self._forward(inp).rows
                    elif isinstance(key, SamplerKey) and not key.grammar:
                        assert inp is not None and hidden is not None  # the forwards come first
                        self._warm_up_sampler(key, inp, hidden)
                    elif p.kind is ProgramKind.ADMIT:
                        self._admit_slot(0, [], [])
                    else:
                        raise AssertionError(f"warm-up has no empty inputs for {p.name}")
                progress.done()
            jax.block_until_ready(([st.kv_cache for st in self.stages], self.last_sampled, self.penalties))
        return time.perf_counter() - t0


def _jit_method(runner: ModelRunner, method: Callable[..., Any], **jit_kwargs: Any) -> Any:
    """`jax.jit` of `runner.method` holding the runner weakly: a jitted bound method kept on
    the runner is a reference cycle, which kept a dropped engine's compiled programs (and
    ~10,000 memory maps of them) alive until Python's cyclic collector ran."""
    ref = weakref.ref(runner)

    def call(*args: Any) -> Any:
        return method(ref(), *args)

    call.__name__ = call.__qualname__ = method.__name__  # the programs' names: jit_stage_fn, ...
    return jax.jit(call, **jit_kwargs)
