"""What the compiler says a --roofline step costs, beside the ideal (jaxserve/roofline.py).

A step's compiled bytes (flops), every device together:

    the forward program at the step's token bucket       XLA's cost analysis
  + the attention kernel's cache reads for the step's    the kernel's `step_cost`, from its
    lengths, x layers                                    own block plan (kernels_pallas)
  + the greedy sampler at the step's row bucket          XLA's cost analysis

A compiled program cannot know a step's lengths, so the kernels' cost estimates count their q
and output only, and the cache they read is added here from the same plan the kernel walks
(whole kv blocks, a layout's padding, past-the-end pages: all bytes the kernel reads).

XLA's cost analysis counts a while loop's body once. Where the platform scans over layers (TPU,
CPU), the forward is costed from an unrolled copy compiled for the purpose
(`ModelOptions.layer_unroll`); GPUs run the unrolled program itself. Differencing a scan
unrolled by 1 and by 2 was tried and dropped: XLA lays the two loops out differently (v6e: a
2-layer body costs 5x a 1-layer one; an odd layer count copies the whole stack). What only the
scanned program does (tpu7x's relayout of a stack before the loop) shows in its temp, which the
rows carry beside (`temp_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import kernels_pallas
from jaxserve.roofline import Row
from jaxserve.worker.programs import Program, ProgramKind, SamplerKey, compile_programs
from jaxserve.worker.sampler import SamplerMode

Cost = tuple[float, float]  # (flops, bytes accessed), per device


def _total(results: list[Any]) -> Cost | None:
    """The summed cost of a bucket's programs (one per pipeline stage); None if any is not costed."""
    if not results or any(isinstance(c, BaseException) or c.flops is None or c.bytes_accessed is None
                          for c in results):
        return None
    return sum(c.flops for c in results), sum(c.bytes_accessed for c in results)


def forward_costs(worker: Any, num_pages: int, buckets: list[int], programs: list[Program],
                  compiled: list[Any], options: dict[str, Any] | None, threads: int
                  ) -> tuple[dict[int, Cost | None], float]:
    """Each token bucket's forward cost, all stages: the compiled programs themselves where the
    layers are unrolled, else an unrolled copy compiled here; and the seconds that took."""
    num_layers = worker.run_arch.num_hidden_layers
    if worker.model_options.scan_unroll(num_layers) == num_layers:
        by_bucket: dict[int, list[Any]] = {}
        for p, c in zip(programs, compiled):
            if p.kind is ProgramKind.FORWARD and p.at_warm_up and p.bucket in buckets:
                by_bucket.setdefault(p.bucket, []).append(c)
        return {b: _total(by_bucket.get(b, [])) for b in buckets}, 0.0
    saved = worker.model_options
    worker.model_options = dataclasses.replace(saved, layer_unroll=num_layers)
    try:
        worker.load_abstract_model()
        runner = worker.make_runner(num_pages, abstract=True)
        copies = [p for p in runner.programs(on_first_use=False)
                  if p.kind is ProgramKind.FORWARD and p.bucket in buckets]
        results = compile_programs(copies, options, threads)
    finally:
        worker.model_options = saved
        worker.load_abstract_model()
    by_bucket = {}
    for p, c in zip(copies, results):
        by_bucket.setdefault(p.bucket, []).append(c)
    seconds = sum(c.compile_s for c in results if not isinstance(c, BaseException))
    return {b: _total(by_bucket.get(b, [])) for b in buckets}, seconds


def kernel_cost(worker: Any, q_lens: list[int], kv_lens: list[int]) -> Cost:
    """The attention kernel's (flops, cache bytes) over every layer, per device; (0, 0) for
    XLA's own attention (the reference backend), which the program's cost already counts."""
    backend = kernels_pallas.get_backend(worker.attention_backend)
    if backend.step_cost is None:
        return 0.0, 0.0
    tp = worker.config.parallel_config.tensor_parallel_size
    nbytes, flops = backend.step_cost(worker.kv_layout, worker.run_arch.num_attention_heads // tp,
                                      worker.config.cache_config.block_size, q_lens, kv_lens)
    layers = len(worker.run_arch.attention_layers)  # a hybrid's linear layers have no pages
    return float(flops * layers), float(nbytes * layers)


GREEDY = SamplerKey(0, SamplerMode.GREEDY, False, False)  # the sampler a step's cost counts


def _greedy_rows(p: Program) -> int | None:
    """The row bucket of a greedy sampler program; None for any other program."""
    return p.key.rows if isinstance(p.key, SamplerKey) and p.key.alike() == GREEDY else None


def greedy_samplers(worker: Any, num_pages: int, options: dict[str, Any] | None, threads: int
                    ) -> tuple[list[Program], list[Any], float]:
    """The greedy sampler of each row bucket, compiled here (when the preflight's --programs
    left the samplers out), their results and the seconds that took."""
    runner = worker.make_runner(num_pages, abstract=True)
    programs = [p for p in runner.programs(on_first_use=False)
                if _greedy_rows(p) is not None]
    results = compile_programs(programs, options, threads)
    return programs, results, sum(c.compile_s for c in results if not isinstance(c, BaseException))


def costed_rows(rows: list[Row], worker: Any, num_pages: int, programs: list[Program],
                compiled: list[Any], options: dict[str, Any] | None,
                threads: int) -> tuple[list[Row], float]:
    """`rows` with `compiled_bytes` / `compiled_flops` (None where a program is not costed or
    the step needs more tokens than the largest bucket), and the seconds its compiles took.
    `compiled`: each of `programs`' results with `flops` and `bytes_accessed` (the preflight's
    ProgramResults; a failed compile's are None). Greedy samplers missing from `programs` are
    compiled here."""
    buckets = sorted({r.bucket for r in rows if r.bucket is not None})
    forwards, seconds = forward_costs(worker, num_pages, buckets, programs, compiled, options, threads)
    if all(_greedy_rows(p) is None for p in programs):
        samplers, results, sampler_s = greedy_samplers(worker, num_pages, options, threads)
        programs, compiled, seconds = [*programs, *samplers], [*compiled, *results], seconds + sampler_s
    greedy: dict[int, Cost | None] = {}
    for p, c in zip(programs, compiled):
        if (bucket := _greedy_rows(p)) is not None:
            greedy[bucket] = _total([c])
    tp = worker.config.parallel_config.tensor_parallel_size
    out = []
    for r in rows:
        q_lens, kv_lens = ([1] * r.batch, [r.context] * r.batch) if r.program == "decode" else (
            [r.context], [r.context])
        fwd = forwards.get(r.bucket) if r.bucket is not None else None
        rows_bucket = min((R for R in greedy if R >= len(q_lens)), default=None)
        sample = greedy.get(rows_bucket) if rows_bucket is not None else None
        if fwd is None or sample is None:
            out.append(r)
            continue
        kflops, kbytes = kernel_cost(worker, q_lens, kv_lens)
        out.append(dataclasses.replace(
            r, compiled_flops=tp * (fwd[0] + kflops + sample[0]),
            compiled_bytes=tp * (fwd[1] + kbytes + sample[1]),
            compiled_parts={"forward": (tp * fwd[0], tp * fwd[1]),
                            "attention": (tp * kflops, tp * kbytes),
                            "sampler": (tp * sample[0], tp * sample[1])}))
    return out, seconds
