"""The engine's compiled programs as data: what warm-up builds, what a device compiler checks.

`ModelRunner.programs()` lists every program the engine runs (each forward token bucket and
pipeline stage, the sampler in every mode and request bucket, the verification sampler, and the
variants compiled on first use: prompt logprobs, pooling, grammar bitmasks) with abstract arguments
(`jax.ShapeDtypeStruct`s carrying their shardings) and its key (`ForwardKey`, `SamplerKey`,
`TokensKey`): the static variant warm-up runs, sizing groups and the sampler's timings name. `compile_program` runs the real compiler
for the arguments' devices, which may be compile-only TPU topologies or CUDA target specs
(jaxserve/preflight.py), and reads back what the device would hold:

    argument bytes   weights, cache, state (per device)
    temp bytes       the program's activations      <- KV-cache sizing (worker/kv_sizing.py)
    alias bytes      arguments updated in place     <- the KV cache must be among them

and whether the program copies the KV cache (a relayout into a kernel's layout shows up as a
`copy` of the cache's shape: a whole cache of traffic and memory every step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.worker.compile_progress import CompileProgress
from jaxserve.worker.sampler import SamplerMode

COMPILE_THREAD_STACK_BYTES = 512 << 20


class ProgramKind(enum.StrEnum):
    """What a program does (preflight's --programs takes these names)."""

    FORWARD = "forward"
    SAMPLE = "sample"
    VERIFY = "verify"  # the speculative-decoding sampler
    PROMPT_LOGPROBS = "prompt_logprobs"
    POOL = "pool"
    ADMIT = "admit"


@dataclasses.dataclass(frozen=True)
class ForwardKey:
    """A forward program's static variant (`ModelRunner.stage_fn`'s first argument)."""

    stage: int  # the pipeline stage
    tokens: int  # the token bucket
    all_rows: bool = False  # also every token's final states (prompt logprobs, pooling)

    @property
    def bucket(self) -> int:
        return self.tokens

    def alike(self) -> ForwardKey:
        """The key of every bucket of this variant."""
        return dataclasses.replace(self, tokens=0)


@dataclasses.dataclass(frozen=True)
class SamplerKey:
    """A sampler program's static variant (`ModelRunner.sample_fn`'s first argument), and
    the key of the sampler's warm-up timings (`ModelRunner.sample_time_s`)."""

    rows: int  # the sampled-rows bucket
    mode: SamplerMode
    verify: bool  # the rejection sampler (speculative decoding)
    processors: bool  # the penalties and logits processors run (sampler.needs_processors)
    grammar: bool = False  # a grammar bitmask argument (one of the processors)

    @property
    def bucket(self) -> int:
        return self.rows

    def alike(self) -> SamplerKey:
        return dataclasses.replace(self, rows=0)


@dataclasses.dataclass(frozen=True)
class TokensKey:
    """A program over every token row of a bucket (prompt logprobs, pooling)."""

    tokens: int

    @property
    def bucket(self) -> int:
        return self.tokens

    def alike(self) -> TokensKey:
        return TokensKey(0)


ProgramKey = ForwardKey | SamplerKey | TokensKey


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the engine, with abstract (or concrete) arguments."""

    name: str  # e.g. "forward[T=512]", "sample[R=64, greedy]"
    kind: ProgramKind
    fn: jax.stages.Wrapped  # the jitted function the runner dispatches
    # Its arguments: static values (a forward's or a sampler's first: its key) and pytrees of
    # ShapeDtypeStructs or arrays (a table of programs of every signature: Any).
    args: tuple[Any, ...]
    mesh: Mesh
    cache_arg: int | None = None  # index of the donated KV cache in `args`, if any
    at_warm_up: bool = True  # False: compiled on first use (a request kind that needs it)
    key: ProgramKey | None = None  # its static variant (None: the admission, or a test's)

    @property
    def bucket(self) -> int:
        """Its token or row bucket (0: none)."""
        return self.key.bucket if self.key is not None else 0

    @property
    def group(self) -> tuple[ProgramKind, ProgramKey | None]:
        """Programs alike but for the bucket share it (sizing takes the largest)."""
        return self.kind, self.key.alike() if self.key is not None else None


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """What the compiler reported for one program (bytes are per device)."""

    name: str
    kind: str
    at_warm_up: bool
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    cache_bytes: int  # the KV cache argument's bytes (0 without one)
    cache_copies: int  # copies of the KV cache's shape in the compiled program
    # XLA's cost analysis (per device; None where the backend does not cost the program). It
    # counts a while loop's body once: worker/program_cost.py costs an unrolled copy instead.
    flops: float | None = None
    bytes_accessed: float | None = None

    @property
    def activation_bytes(self) -> int:
        """What the program needs beyond its arguments: temp plus outputs not aliased."""
        return self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0)

    def problems(self) -> list[str]:
        """Why this program is not device-clean (empty when it is)."""
        out = []
        if self.cache_bytes and self.alias_bytes < self.cache_bytes:
            out.append(f"the KV cache ({self.cache_bytes} B) is not aliased to an output "
                       f"(alias {self.alias_bytes} B): it would be copied every step")
        if self.cache_copies:
            out.append(f"{self.cache_copies} copies of the KV cache inside the step (a relayout)")
        return out


def abstract(x: Any, sharding: Any) -> Any:
    """The pytree `x` as ShapeDtypeStructs placed with `sharding` (one, or a matching tree)."""
    if not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            x, sharding)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), x)


def per_device_bytes(tree: Any) -> int:
    """Bytes the largest device holds of a pytree of (abstract or concrete) sharded arrays."""
    total = 0
    for a in jax.tree.leaves(tree):
        sharding = getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if sharding is not None else a.shape
        total += int(np.prod(shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(a.dtype) // 8
    return total


def _local_shape_text(x: Any) -> str:
    """How the compiled HLO spells one device's shard of `x`'s shape: "[30,1024,16,256]"."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return "[" + ",".join(map(str, shape)) + "]"


def count_cache_copies(hlo: str, cache: Any) -> int:
    """`copy` / `copy-start` instructions producing an array of a cache shard's shape (each
    array of the cache: a hybrid's pages and state pools too)."""
    total = 0
    for leaf in jax.tree.leaves(cache):
        shape = re.escape(_local_shape_text(leaf))
        pattern = re.compile(r"=\s*\w+" + shape + r"\{[^}]*\}\s+copy(-start)?\(")
        total += len(pattern.findall(hlo))
    return total


@contextlib.contextmanager
def without_persistent_cache() -> Iterator[None]:
    """Compile-only executables cannot be loaded back from JAX's persistent cache: keep them
    out of it (and off the user's disk) inside the block, then give the process its cache
    back. JAX decides once per process whether it caches, hence the resets."""
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]  # set at run time
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def lower_program(program: Program) -> jax.stages.Lowered:
    """Trace and lower `program` on the calling thread. Tracing runs Python (Flax modules,
    JAX's tracing state) that is not safe to run from several threads at once."""
    with jax.set_mesh(program.mesh):  # Pallas TPU reads the generation from the mesh's devices
        return program.fn.trace(*program.args).lower()


def compile_lowered(program: Program, lowered: jax.stages.Lowered,
                    compiler_options: dict[str, Any] | None = None, lower_s: float = 0.0
                    ) -> tuple[CompiledProgram, jax.stages.Compiled]:
    """Compile a lowered `program` for its arguments' devices (the device compiler runs: Mosaic
    for TPU kernels, Triton and ptxas for GPU ones) and read back its report. XLA compiles
    outside the GIL: safe to call from several threads. Raises the compiler's error."""
    t0 = time.perf_counter()
    with jax.set_mesh(program.mesh):
        compiled = lowered.compile(compiler_options or None)
    seconds = lower_s + time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is None:  # every backend jaxserve compiles for reports it; KV sizing depends on it
        raise RuntimeError(f"{program.name}: the compiler reported no memory analysis")
    cache = program.args[program.cache_arg] if program.cache_arg is not None else None
    copies = count_cache_copies(compiled.as_text() or "", cache) if cache is not None else 0
    flops, bytes_accessed = cost_analysis(compiled)
    report = CompiledProgram(
        program.name, program.kind, program.at_warm_up, seconds,
        int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
        int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes),
        per_device_bytes(cache) if cache is not None else 0, copies, flops, bytes_accessed)
    return report, compiled


def compile_program(program: Program, compiler_options: dict[str, Any] | None = None
                    ) -> tuple[CompiledProgram, jax.stages.Compiled]:
    """Lower and compile `program` on this thread: the report and the compiled executable.
    Raises the tracer's or the compiler's error."""
    t0 = time.perf_counter()
    lowered = lower_program(program)
    return compile_lowered(program, lowered, compiler_options, time.perf_counter() - t0)


def cost_analysis(compiled: Any) -> tuple[float | None, float | None]:
    """(flops, bytes accessed) of a compiled program as XLA's cost analysis counts them; None
    for what the backend does not report (never 0 for "not costed")."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without a cost model
        return None, None
    cost = (cost[0] if cost else None) if isinstance(cost, list) else cost
    if not cost:
        return None, None
    flops, nbytes = cost.get("flops"), cost.get("bytes accessed")
    return (None if flops is None else float(flops)), (None if nbytes is None else float(nbytes))


def signature(program: Program) -> Hashable:
    """What a program's executable is made from besides its function's code: its name (the
    static variant) and its arguments' structure, shapes, dtypes and shardings."""
    leaves, tree = jax.tree.flatten(program.args)
    return (program.name, program.kind, tree, tuple(
        (leaf.shape, leaf.dtype, getattr(leaf, "sharding", None)) if hasattr(leaf, "shape")
        else leaf for leaf in leaves))


def compile_programs(programs: list[Program], compiler_options: dict[str, Any] | None = None,
                     threads: int = 1, progress: CompileProgress | None = None,
                     compiled: Mapping[Hashable, CompiledProgram] | None = None
                     ) -> list[CompiledProgram | BaseException]:
    """`compile_program` for each, in order; a failed trace or compile is its exception.
    Programs are traced and lowered one after another on this thread; with `threads` > 1 their
    compiles (outside the GIL) run in that many threads while the next ones are lowered.
    `progress`: where the count goes (default: a bar on a terminal, else log lines).
    `compiled`: reports by `signature` of programs compiled before (KV-cache sizing's), counted
    and returned rather than compiled again."""
    if progress is None:
        progress = CompileProgress(len(programs))
    known = compiled or {}
    keys = [signature(p) for p in programs] if known else [None] * len(programs)
    todo = [p for p, k in zip(programs, keys) if k not in known]
    with progress:
        for _ in range(len(programs) - len(todo)):
            progress.done()
        if threads <= 1:
            results = [_compile_counted(progress, functools.partial(_compile_one, p, compiler_options),
                                        p.name) for p in todo]
        else:
            results = _compile_in_threads(todo, compiler_options, threads, progress)
    fresh = iter(results)
    return [known[k] if k in known else next(fresh) for k in keys]


def _compile_in_threads(programs: list[Program], compiler_options: dict[str, Any] | None,
                        threads: int, progress: CompileProgress
                        ) -> list[CompiledProgram | BaseException]:
    # The TPU compiler recurses deeply (tpu7x's SparseCore lowering overflowed a default
    # 8 MiB thread stack): give the compile threads the room a main thread has and more.
    previous = threading.stack_size(COMPILE_THREAD_STACK_BYTES)
    try:
        with ThreadPoolExecutor(threads) as pool:
            pending: list[Future[CompiledProgram | BaseException] | BaseException] = []
            for p in programs:
                t0 = time.perf_counter()
                try:
                    with progress.compiling(p.name):
                        lowered = lower_program(p)
                except Exception as e:  # noqa: BLE001 - the tracer's error is the result
                    progress.done(ok=False)
                    pending.append(e)
                    continue
                # Named as compiling once a thread takes it up, not while it waits in the queue.
                pending.append(pool.submit(
                    _compile_counted, progress, functools.partial(
                        _compile_report, p, lowered, compiler_options, time.perf_counter() - t0),
                    p.name))
            return [r if isinstance(r, BaseException) else r.result() for r in pending]
    finally:
        threading.stack_size(previous)


def _compile_one(program: Program, compiler_options: dict[str, Any] | None) -> CompiledProgram:
    return compile_program(program, compiler_options)[0]


def _compile_report(program: Program, lowered: jax.stages.Lowered,
                    compiler_options: dict[str, Any] | None, lower_s: float) -> CompiledProgram:
    return compile_lowered(program, lowered, compiler_options, lower_s)[0]


def _compile_counted(progress: CompileProgress, fn: Callable[[], CompiledProgram], name: str
                     ) -> CompiledProgram | BaseException:
    """`fn`'s report or its exception, counted in `progress` under `name`."""
    with progress.compiling(name):
        result = _result(fn)
    progress.done(ok=not isinstance(result, BaseException))
    return result


def _result(fn: Callable[[], CompiledProgram]) -> CompiledProgram | BaseException:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        return e


def sizing_programs(programs: list[Program]) -> list[Program]:
    """The programs whose activations bound the others': the largest bucket of each forward
    (per stage), of the filtered-mode samplers (top-k/top-p sort: the largest temp of the
    modes) and of prompt logprobs. Only the forwards take the KV cache; the others are the
    very programs warm-up and first use compile (JAX's persistent cache serves them again)."""
    largest: dict[tuple[ProgramKind, ProgramKey | None], Program] = {}
    for p in programs:
        key = p.key
        wanted = ((p.kind is ProgramKind.FORWARD and p.at_warm_up)
                  or p.kind is ProgramKind.PROMPT_LOGPROBS
                  or (isinstance(key, SamplerKey) and key.mode is SamplerMode.FILTERED
                      and key.processors and not key.grammar))
        if wanted and (p.group not in largest or p.bucket > largest[p.group].bucket):
            largest[p.group] = p
    return list(largest.values())
