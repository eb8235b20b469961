"""ModelRunner: SchedulerOutput -> padded device inputs -> compiled step -> tokens.

Two compiled programs per step (one forward per pipeline stage), each bucketed
on one axis so their count stays small (|token buckets| + 3 x |request buckets|,
all compiled at warm-up):

    forward[T]        (params, kv_cache*, last_sampled, packed inputs) -> kv_cache, hidden[S]
                      runs the decoder over T (padded) tokens and keeps the hidden
                      state of each request's last token only
    sample[R, mode, verify]
                      (params, hidden[P], last_sampled*, penalty state*, packed sampling md)
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

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.models import AttentionMetadata, LlamaForCausalLM
from jaxserve.models.variables import model_variables
from jaxserve.parallel.pipeline import Stage
from jaxserve.worker.buckets import MIN_TOKEN_BUCKET, pad_to_bucket, request_buckets, token_buckets
from jaxserve.worker.input_batch import InputBatch, StepInputs, as_dict
from jaxserve.worker.packing import Packing
from jaxserve.worker.programs import Program, ProgramKind, abstract as abstract_tree, runner_programs
from jaxserve.worker.penalty_state import PenaltyState, admit, admit_inputs, after_sampling
from jaxserve.worker.pooler import Pooler, pool_sums
from jaxserve.worker.rejection_sampler import rejection_sample
from jaxserve.worker.sampler_inputs import (grammar_bitmask, sampler_packing, sampling_inputs,
                                            verify_inputs)
from jaxserve.worker.step_handle import (CompileMonitor, PreparedStep, PromptLogprobRows,
                                         StepFacts, StepHandle, host_array,
                                         prompt_logprobs_output, sampled_output)
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.worker.sampler import SamplerMode, SamplingMetadata, sample

logger = logging.getLogger(__name__)


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
        radix_bits: int = 1,
        pooler: Pooler | None = None,
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
        `radix_bits`: bits of top-k / top-p's threshold found per pass over the vocabulary
        (sampler.largest_threshold: fewer passes, 2^bits - 1 compares each).
        `pooler`: the pooling requests' (worker/pooler.py; a classifier's holds its head)."""
        self.stages = stages
        self.logprobs_branch = logprobs_branch
        self.radix_bits = radix_bits
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
        self.verify_buckets = request_buckets(max_verify_rows) if max_verify_rows else ()
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
        self.stage_observer: Callable[[int, int, Any], None] | None = None
        self._num_steps = 0
        self.penalties = place(PenaltyState.zeros(S, V), replicated)
        # The compiled programs (public: worker/programs.py lists them for the warm-up, the
        # KV-cache sizing and the preflight; `*_fn` are their traced functions).
        self.stage_program = jax.jit(self.stage_fn, static_argnums=(0, 1, 2), donate_argnums=(4,))
        self.prompt_logprobs_program = jax.jit(self.prompt_logprobs_fn, out_shardings=replicated)
        self.pooler = pooler or Pooler(S)
        self.pool_program = jax.jit(pool_sums, static_argnums=(2,), out_shardings=replicated)
        # Sampler results are replicated so every process (multi-host) holds them whole.
        self.sample_program = jax.jit(
            self.sample_fn, static_argnums=(0, 1, 2, 3), donate_argnums=(6, 7),
            out_shardings=replicated,
        )
        self.admit_program = jax.jit(admit, donate_argnums=(0,))
        # Device seconds of each (rows bucket, mode, verify, processors) sampler, timed at warm-up:
        # traces split a step's device time into forward and sampler with it.
        self.sample_time_s: dict[tuple[int, SamplerMode, bool, bool], float] = {}
        CompileMonitor.install()

    # ---- compiled programs -------------------------------------------------------------

    def forward_packing(self, num_tokens: int) -> Packing:
        return StepInputs.packing(num_tokens, self.max_num_seqs, self.batch.max_pages,
                                  self.num_logit_rows, self.batch.num_groups)

    def stage_fn(self, index: int, num_tokens: int, all_rows: bool, params, kv_cache, x, buf):
        """One pipeline stage (the whole model when pp = 1) over a `num_tokens` bucket.

        The first stage embeds (x = last_sampled: tokens sampled by the previous step
        have not reached the host, so they are read here); the others continue from
        the hidden states x. The last stage keeps each request's last hidden state.
        """
        inp = StepInputs(**self.forward_packing(num_tokens).unpack(buf))
        st = self.stages[index]
        params = model_variables(params)  # int8 layer weights: a collection of their own
        if st.is_first:
            input_ids = jnp.where(inp.prev_slot >= 0, x[jnp.maximum(inp.prev_slot, 0)], inp.input_ids)
            x = st.model.apply(params, input_ids, method=LlamaForCausalLM.embed)
        md = AttentionMetadata(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
        h, kv_cache = st.model.apply(params, x, inp.positions, kv_cache, md, method=LlamaForCausalLM.run_layers)
        if st.is_last:
            # A fixed number of rows, so the sampler's shapes do not depend on T.
            rows = jnp.pad(inp.logits_indices, (0, self.num_logit_rows - inp.logits_indices.shape[0]))
            normed = st.model.apply(params, h, method=LlamaForCausalLM.final_norm)
            # all_rows (prompt logprobs): every token's state too, not only the sampled rows.
            h = (normed[rows], normed) if all_rows else normed[rows]
        return kv_cache, h

    def _forward(self, inp: StepInputs, all_rows: bool = False) -> Any:
        """Run every stage; activations hop to the next stage's devices asynchronously.
        Returns the sampled rows' final states, and with `all_rows` every token's too."""
        T = inp.input_ids.shape[0]
        buf = self.forward_packing(T).pack(as_dict(inp))
        x = self.last_sampled if (inp.prev_slot >= 0).any() else self._no_sampled
        self._num_steps += 1
        for st in self.stages:
            if len(self.stages) > 1:
                x = jax.device_put(x, st.replicated)
            st.kv_cache, x = self.stage_program(st.index, T, all_rows and st.is_last, st.params,
                                         st.kv_cache, x, jax.device_put(buf, st.replicated))
            if self.stage_observer is not None:
                self.stage_observer(self._num_steps, st.index, x)
        return x

    def prompt_logprobs_fn(self, params, hidden, targets):
        """Per token row: the logprob of `targets` (the next prompt token), then the top-N,
        and the target's rank; from the raw model distribution, as sampled logprobs."""
        logits = self.model.apply(params, hidden, method=LlamaForCausalLM.compute_logits)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top_v, top_i = jax.lax.top_k(lp, MAX_LOGPROBS)
        target_lp = jnp.take_along_axis(lp, targets[:, None], axis=-1)
        ranks = 1 + jnp.sum(lp > target_lp, axis=-1).astype(jnp.int32)
        return (jnp.concatenate([targets[:, None], top_i.astype(jnp.int32)], axis=-1),
                jnp.concatenate([target_lp, top_v], axis=-1), ranks)

    def _prompt_rows(self, req_ids: list[str], slots: np.ndarray, inp: StepInputs,
                     T: int) -> tuple[np.ndarray, list[PromptLogprobRows]] | None:
        """The step's token rows that are prompt positions of prompt_logprobs requests (each
        predicting the next prompt token), or None when no request needs any."""
        b = self.batch
        wanted = np.flatnonzero(b.prompt_logprobs[slots] >= 0)
        if not len(wanted):
            return None
        targets, rows = np.zeros(T, np.int32), []
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
        return (targets, rows) if rows else None

    def sample_fn(self, num_rows: int, mode: SamplerMode, verify: bool, processors: bool, params,
                  hidden, last_sampled, penalties: PenaltyState, buf, bitmask=None):
        """`processors`: some row has a penalty or logits processor (needs_processors); else
        no per-slot [vocab] state is read or updated."""
        u = sampler_packing(num_rows, verify).unpack(buf)
        slots, real = u.pop("slots"), u.pop("real")
        drafts = (u.pop("draft_ids"), u.pop("group_first")) if verify else ()
        wanted = u.pop("logprobs")
        md = SamplingMetadata(**u, logprobs=wanted if self.logprobs_branch else None)
        # An identity barrier: XLA's Triton GEMM emitter fails on a one-row slice fused into
        # the LM head (R = 1 on H100/H200: "Reshape input and output shapes must be the same")
        rows = jax.lax.optimization_barrier(hidden[:num_rows])
        logits = self.model.apply(params, rows, method=LlamaForCausalLM.compute_logits)
        rows = jnp.minimum(slots, self.max_num_seqs - 1)
        args: tuple[Any, ...] = (logits, None, None, md, mode, None)
        if processors:
            args = (logits, penalties.prompt_mask[rows], penalties.output_counts[rows], md, mode,
                    penalties.processors(rows, bitmask))
        out = (rejection_sample(*args, *drafts, self.radix_bits) if verify
               else sample(*args, self.radix_bits))
        # Padding rows carry slot S (out of range): mode="drop" discards their writes.
        S = self.max_num_seqs
        last_sampled = last_sampled.at[slots if not verify else jnp.where(out.final, slots, S)
                                       ].set(out.sampled, mode="drop")
        if processors:  # one token a step per request: in a verification step, its final one
            penalties = after_sampling(penalties, slots, rows, out.sampled,
                                       real if not verify else real & out.emitted,
                                       real if not verify else real & out.final)
        return last_sampled, penalties, out

    # ---- per step ----------------------------------------------------------------------

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Update the batch from `so`, dispatch the step and return without waiting."""
        compiles, compile_s = CompileMonitor.count, CompileMonitor.seconds
        self._update_batch(so)
        step = self._prepare(so)
        if step is None:
            return StepHandle(self, None)
        hidden, prompt_out, pool_out = self._run_forward(step)
        bitmask = grammar_bitmask(so.grammar_bitmask, step.req_ids, step.per_req, step.R,
                                  self.model.cfg.vocab_size)
        out = self._run_sampler(step, hidden, bitmask)
        key = (step.R, step.sampler.mode, step.verify, step.sampler.processors)
        facts = StepFacts(self.sample_time_s.get(key, 0.0),
                          CompileMonitor.count - compiles, CompileMonitor.seconds - compile_s)
        first_positions = None
        if self.record_sampled:
            n, per_req = len(step.req_ids), step.per_req
            first_positions = step.inp.kv_lens[:n] - (0 if per_req is None else per_req - 1)
        return StepHandle(self, step, out=out, num_logprobs=self.batch.num_logprobs[step.slots].copy(),
                          prompt_out=prompt_out, pool_out=pool_out, facts=facts,
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

    def _run_forward(self, step: PreparedStep) -> tuple[Any, Any, Any]:
        """Dispatch the forward; (the sampled rows' hidden states, prompt logprobs or None,
        pooled sums or None)."""
        hidden = self._forward(step.inp, all_rows=step.prompt is not None or step.pool is not None)
        if step.prompt is None and step.pool is None:
            return hidden, None, None
        # Compiled on first use (rare request kinds; warm-up does not cover them).
        hidden, every_token = hidden
        prompt_out = pool_out = None
        if step.prompt is not None:
            targets, rows = step.prompt
            prompt_out = (self.prompt_logprobs_program(self.params, every_token, targets), rows)
        if step.pool is not None:
            segments, pool_rows = step.pool
            pool_out = (self.pool_program(every_token, segments, self.max_num_seqs), pool_rows,
                        every_token if Pooler.wants_rows(pool_rows) else None)
        return hidden, prompt_out, pool_out

    def _run_sampler(self, step: PreparedStep, hidden: Any, bitmask: np.ndarray | None) -> Any:
        """Dispatch the sampler (or the verification sampler); its device outputs."""
        # NOTE: no bitmask argument at all without one: an explicit None would be another
        # call signature to jit, and compile again what warm-up compiled. With one, the
        # program variant is compiled on first use, like prompt logprobs.
        # A grammar's bitmask is one of the logits processors.
        processors = step.sampler.processors or bitmask is not None
        self.last_sampled, self.penalties, out = self.sample_program(
            step.R, step.sampler.mode, step.verify, processors, self.params, hidden,
            self.last_sampled, self.penalties, step.sampler.packed,
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
            self._admit_slot(slot, new.prompt_token_ids, new.output_token_ids, stop, p.logit_bias,
                             p.allowed_token_ids, p.bad_words_token_ids)

    def _admit_slot(self, slot: int, *args: Any) -> None:
        """Reset `slot`'s sampler state for a request: admit_inputs' arguments."""
        arrays = admit_inputs(self.batch.max_model_len, self.model.cfg.vocab_size, *args)
        self.penalties = self.admit_program(self.penalties, np.int32(slot), *arrays)

    def read_output(self, handle: StepHandle) -> ModelRunnerOutput:
        """A dispatched step's tokens, logprobs and trace facts on the host: the step's device
        sync (the bench and `StageTimeline` wrap it to time and order the reads)."""
        step, out = handle.step, handle.out
        if step is None or out is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        result = sampled_output(step, out, handle.num_logprobs)
        if handle.first_positions is not None:
            self.batch.record_sampled(step.req_ids, step.slots, handle.first_positions,
                                      result.sampled_token_ids)
        if handle.prompt_out is not None:
            result.prompt_logprobs = prompt_logprobs_output(*handle.prompt_out)
        if handle.pool_out is not None:
            sums, rows, every_token = handle.pool_out
            result.pooler_output = self.pooler.finish(host_array(sums), rows, every_token)
        f = handle.facts
        result.sample_s, result.num_compiles, result.compile_s = f.sample_s, f.num_compiles, f.compile_s
        return result

    # ---- warm-up -----------------------------------------------------------------------

    def sampler_keys(self) -> list[tuple[int, bool]]:
        """(rows bucket, verify) of every sampler program: request buckets, then the
        verification sampler's row buckets when speculative decoding is on."""
        return ([(R, False) for R in self.request_buckets]
                + [(R, True) for R in self.verify_buckets])

    def state_bytes(self) -> Any:
        """The runner's own device state besides weights and cache (for KV-cache sizing)."""
        return (self.last_sampled, self._no_sampled, self.penalties)

    def _warm_up_sampler(self, R: int, mode: SamplerMode, verify: bool, processors: bool,
                         inp: StepInputs, hidden: Any) -> None:
        """Compile one sampler program on no rows, then time a warm run of it."""
        empty, no_mask = np.zeros(0, np.int32), np.zeros(0, bool)
        md = (verify_inputs(self.batch, inp, empty, no_mask, empty, [], R) if verify
              else sampling_inputs(self.batch, empty, no_mask, empty, R)).packed
        for timed in (False, True):
            jax.block_until_ready(hidden)
            t = time.perf_counter()
            self.last_sampled, self.penalties, out = self.sample_program(
                R, mode, verify, processors, self.params, hidden, self.last_sampled,
                self.penalties, md)
            jax.block_until_ready(out)
            if timed:
                self.sample_time_s[(R, mode, verify, processors)] = time.perf_counter() - t

    def programs(self, on_first_use: bool = True) -> list[Program]:
        """Every program the engine runs, with abstract arguments on this runner's meshes:
        what `warm_up` compiles, then (`on_first_use`) the variants compiled when a request
        first needs them (prompt logprobs, a grammar bitmask). See worker/programs.py."""
        return runner_programs(self, on_first_use)

    def warm_up(self) -> float:
        """Compile and run once every program `programs(on_first_use=False)` lists, so nothing
        compiles while serving: each forward token bucket (all its stages in one pass), each
        (request bucket, sampler mode, with and without processors) and the admission.

        Runs each on empty inputs (no sequences: attention loops zero times, writes land in the
        null page, samples on dropped slots): only a call, not `lower().compile()`, fills jit's
        dispatch cache. Returns the seconds spent."""
        t0 = time.perf_counter()
        programs = self.programs(on_first_use=False)
        empty = np.zeros(0, np.int32)
        inp, hidden = None, None
        # disable=None: a bar on a terminal, nothing in a log file (one line per update there).
        with tqdm(total=len(programs), desc="Compiling buckets", unit="program", disable=None) as bar:
            for p in programs:
                if p.kind is ProgramKind.FORWARD:
                    if p.args[0] == 0:  # the first stage's program: one pass runs every stage
                        inp, _, _ = self.batch.prepare([], empty, p.bucket)
                        hidden = self._forward(inp)
                elif p.kind in (ProgramKind.SAMPLE, ProgramKind.VERIFY):
                    self._warm_up_sampler(*p.args[:4], inp, hidden)
                elif p.kind is ProgramKind.ADMIT:
                    self._admit_slot(0, [], [])
                else:
                    raise AssertionError(f"warm-up has no empty inputs for {p.name}")
                bar.update()
            jax.block_until_ready(([st.kv_cache for st in self.stages], self.last_sampled, self.penalties))
        return time.perf_counter() - t0
