"""`python -m jaxserve.preflight`: will this model and these engine flags run on that chip?

    python -m jaxserve.preflight --model MODEL --target v6e:1x1 [serve's engine flags] [--json]

Answered on a laptop, before renting the chip: the real device compilers (libtpu's Mosaic for
TPUs; XLA, Triton and ptxas for NVIDIA GPUs) compile every program the engine would run, for
compile-only devices of the target (worker/targets.py), with the same code the server runs at
start-up (Worker.plan_memory -> ModelRunner.programs). It reports whether each compiles, the
memory per device (weights, activations, KV cache), how many KV pages and concurrent
max-length sequences fit, and the compile time per program and in total (what warm-up costs).
Weights are not needed: a model folder with its config.json (or the default model's name).

Exit status: 0 when everything compiles and fits, 1 when it does not, 2 for a usage error (an
unknown target, an unsupported architecture, a bad flag: reported before anything compiles).
Needs `pip install -e '.[preflight]'` (libtpu, the CUDA plugin and ptxas).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxserve.chips import CHIPS, chip, parse_prices
from jaxserve.engine.arg_utils import EngineArgs, engine_arg_parser, engine_config_from_args
from jaxserve.models.model_files import ModelFiles, resolve_model
from jaxserve.platforms import select_jax_platforms
from jaxserve.roofline import Row
from jaxserve.worker.kv_sizing import InsufficientMemoryError, MemoryPlan, fmt_bytes
from jaxserve.worker.targets import Target, parse_target, supported_targets

if TYPE_CHECKING:
    from jaxserve.worker.programs import Program, ProgramKind

# By name: run as `python -m`, __name__ is "__main__", outside jaxserve's logger.
logger = logging.getLogger("jaxserve.preflight")

# GPU programs must not spill registers (a spill is local-memory traffic in every step).
GPU_COMPILER_OPTIONS = {"xla_gpu_fail_ptx_compilation_on_register_spilling": True}


@dataclasses.dataclass
class ProgramResult:
    name: str
    kind: str
    at_warm_up: bool
    compile_s: float
    temp_bytes: int = 0
    activation_bytes: int = 0
    argument_bytes: int = 0
    alias_bytes: int = 0
    error: str | None = None  # a compile error, or why the program is not device-clean
    # XLA's cost analysis of the program as compiled (per device; None: not costed). A scan
    # over layers counts its body once: --roofline's rows cost an unrolled copy.
    flops: float | None = None
    bytes_accessed: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class PreflightReport:
    target: str
    device: str
    num_devices: int
    model: str
    architecture: str
    settings: dict[str, Any]
    memory: MemoryPlan | None = None
    programs: list[ProgramResult] = dataclasses.field(default_factory=list)
    error: str | None = None  # a configuration that cannot fit, or programs that failed
    roofline: list[Row] = dataclasses.field(default_factory=list)  # --roofline's steps
    roofline_error: str | None = None  # why there are none (a chip the table lacks)
    roofline_compile_s: float = 0.0  # the unrolled forward copies --roofline costs (TPU)

    @property
    def ok(self) -> bool:
        return self.error is None and self.memory is not None and all(p.ok for p in self.programs)

    def compile_seconds(self, at_warm_up: bool | None = None) -> float:
        return sum(p.compile_s for p in self.programs
                   if at_warm_up is None or p.at_warm_up == at_warm_up)

    def to_json(self) -> dict[str, Any]:
        m = self.memory
        memory = None if m is None else {
            "memory_bytes": m.memory_bytes, "usable_bytes": m.usable_bytes,
            "gpu_memory_utilization": m.utilization, "weight_bytes": m.weight_bytes,
            "activation_bytes": m.activation_bytes, "state_bytes": m.state_bytes,
            "kv_cache_bytes": m.cache_bytes, "kv_bytes_per_token": m.bytes_per_token,
            "num_pages": m.num_pages, "page_size": m.page_size, "max_model_len": m.max_model_len,
            "max_concurrent_seqs": m.max_concurrent_seqs,
            "max_concurrent_seqs_every_page_kept": m.seqs_keeping_every_page,
            "kv_cache_groups": [{"group": name, "pages_per_seq": n}
                                for name, n in m.group_pages()],
            "num_state_slots": m.num_state_slots, "state_pool_bytes": m.state_pool_bytes}
        return {
            "ok": self.ok, "error": self.error, "target": self.target, "device": self.device,
            "num_devices": self.num_devices, "model": self.model,
            "architecture": self.architecture, "settings": self.settings, "memory": memory,
            "compile_s": {"warm_up": round(self.compile_seconds(True), 2),
                          "first_use": round(self.compile_seconds(False), 2),
                          "roofline": round(self.roofline_compile_s, 2),
                          "total": round(self.compile_seconds(), 2)},
            "programs": [dataclasses.asdict(p) for p in self.programs],
        }

    def to_text(self) -> str:
        s = self.settings
        if not s:  # the target failed before the engine was built
            return f"jaxserve preflight: {self.model} on {self.target}\nerror: {self.error}\nresult: FAILED"
        lines = [f"jaxserve preflight: {self.model} ({self.architecture}) on {self.target} "
                 f"({self.device} x {self.num_devices}): tp={s['tensor_parallel_size']} "
                 f"pp={s['pipeline_parallel_size']}, {s['dtype']} weights"
                 f"{' (' + s['quantization'] + ')' if s['quantization'] else ''}"
                 f"{', experts ' + s['experts_quantization'] if s.get('experts_quantization') else ''}"
                 f", KV cache {s['kv_cache']}, "
                 f"max_model_len={s['max_model_len']}, max_num_seqs={s['max_num_seqs']}, "
                 f"max_num_batched_tokens={s['max_num_batched_tokens']}"]
        m = self.memory
        if m is not None:
            lines += [
                f"memory per device: {fmt_bytes(m.memory_bytes)} x {m.utilization:g} = "
                f"{fmt_bytes(m.usable_bytes)} usable",
                f"  weights          {fmt_bytes(m.weight_bytes):>12}",
                f"  activations      {fmt_bytes(m.activation_bytes):>12}  (the largest program's "
                "temp + outputs, from the compiler)",
                f"  sampler state    {fmt_bytes(m.state_bytes):>12}",
                f"  KV cache         {fmt_bytes(m.cache_bytes):>12}  = {m.num_pages} pages of "
                f"{m.page_size} tokens, {fmt_bytes(m.bytes_per_token)} per token of context"]
            if len(m.groups.groups) > 1 or m.groups.has_sliding:
                lines += [f"    group {i}: {name}: {n} pages per sequence"
                          for i, (name, n) in enumerate(m.group_pages())]
            if m.num_state_slots:
                lines.append(
                    f"  linear states    {fmt_bytes(m.state_pool_bytes):>12}  = "
                    f"{m.num_state_slots} slots (slot 0 the null one; at most "
                    f"{m.groups.state_slots_per_request()} per running sequence)")
            lines.append(f"  -> {m.max_concurrent_seqs} sequences of {m.max_model_len} tokens at "
                         "once" + (f" ({m.seqs_keeping_every_page} if every layer kept every page)"
                                   if m.groups.has_sliding else ""))
        if self.programs:
            warm = sum(p.at_warm_up for p in self.programs)
            failed = [p for p in self.programs if not p.ok]
            lines.append(f"programs: {len(self.programs)} compiled ({warm} at warm-up, "
                         f"{len(self.programs) - warm} on first use), {len(failed)} failed")
            lines.append(f"  {'program':<40} {'compile s':>9} {'temp':>12}  status")
            for p in self.programs:
                status = "ok" if p.ok else f"FAIL: {p.error}"
                when = "" if p.at_warm_up else " (first use)"
                lines.append(f"  {p.name + when:<40} {p.compile_s:9.1f} "
                             f"{fmt_bytes(p.temp_bytes):>12}  {status}")
            lines.append(f"compile time: warm-up {self.compile_seconds(True):.1f} s, first-use "
                         f"variants {self.compile_seconds(False):.1f} s, total "
                         f"{self.compile_seconds():.1f} s (each program's own compile on this "
                         "machine's CPU)")
        if self.error:
            lines.append(f"error: {self.error}")
        lines.append("result: " + ("OK: everything compiles and fits" if self.ok else "FAILED"))
        return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    """The engine's flags (as serve takes them; not the HTTP server's), plus --target and
    --json."""
    p = engine_arg_parser("python -m jaxserve.preflight", __doc__.splitlines()[0])
    g = p.add_argument_group("preflight")
    g.add_argument("--target", required=True, nargs="+",
                   help=f"the device(s) to compile for, one after another (give MODEL before "
                        f"--target, or as --model): {supported_targets()}")
    g.add_argument("--roofline", action="store_true",
                   help="estimate each target's speed: the ideal decode and prefill steps at the "
                        "chip's HBM bandwidth and peak (an upper bound; jaxserve/roofline.py), "
                        "tokens/s and dollars per million output tokens")
    g.add_argument("--price", nargs="+", default=None, metavar="CHIP=USD",
                   help="on-demand USD per chip-hour, over jaxserve/chips.py's (e.g. tpu7x=6.0)")
    g.add_argument("--json", action="store_true", help="print the report as one JSON object")
    g.add_argument("--only-warm-up", action="store_true",
                   help="compile only warm-up's programs, not the first-use variants")
    g.add_argument("--programs", default=None, metavar="KINDS",
                   help="only these kinds of programs, comma-separated (forward, sample, "
                        "verify, prompt_logprobs, pool, admit); default: all. --roofline's "
                        "compiled costs need forward (the greedy samplers they count are "
                        "compiled for them if sample is left out)")
    g.add_argument("--compile-threads", type=int, default=None,
                   help="GPU targets: compiles at once (default: one per CPU core, at most 4); "
                        "TPU programs always compile one at a time")
    EngineArgs.add_cli_args(p)
    return p


def validate(args: argparse.Namespace) -> tuple[list[Target], Any, ModelFiles, Any]:
    """Everything checkable without JAX (fast): the target, the flags, the model's
    architecture. Raises ValueError / FileNotFoundError with the message to show."""
    for name in ("model", "model_tag"):  # config.json alone: its folder (no weights needed)
        path = getattr(args, name)
        if path and os.path.basename(path) == "config.json":
            setattr(args, name, os.path.dirname(os.path.abspath(path)))
    targets = [parse_target(t) for t in args.target]
    config = engine_config_from_args(args)
    files = resolve_model(config.model_config.model, config.model_config.hf_overrides)
    from jaxserve.models.loaders import read_arch  # HF: config.json only, no JAX

    return targets, config, files, read_arch(files)


def run_preflight(config: Any, target: Target, files: ModelFiles, on_first_use: bool = True,
                  threads: int | None = None, kinds: tuple[ProgramKind, ...] | None = None,
                  roofline: bool = False, only: Callable[[Program], bool] | None = None
                  ) -> PreflightReport:
    """Size the cache and compile every program for `target` (the JAX part); `threads`
    compiles at once for a GPU (default: one per CPU core, at most 4); `kinds` keeps only
    programs of those kinds ("forward", "sample", ...), `only` those it is true of."""
    from jaxserve.worker.programs import without_persistent_cache

    with without_persistent_cache():
        return _run(config, target, files, on_first_use, threads, kinds, roofline, only)


def _run(config: Any, target: Target, files: ModelFiles, on_first_use: bool,
         threads: int | None, kinds: tuple[ProgramKind, ...] | None,
         roofline: bool = False, only: Callable[[Program], bool] | None = None) -> PreflightReport:
    import jax

    from jaxserve.engine.build import resolved_of
    from jaxserve.engine.resolve import resolve_engine_config
    from jaxserve.worker.compile_progress import CompileProgress
    from jaxserve.worker.programs import ProgramKind, compile_programs
    from jaxserve.worker.targets import make_devices
    from jaxserve.worker.worker import Worker

    pc = config.parallel_config
    devices = make_devices(target, pc.tensor_parallel_size * pc.pipeline_parallel_size)
    config = resolve_engine_config(config, files, devices)
    worker = Worker(config, files, devices=devices)
    worker.load_abstract_model()
    cc, sc = config.cache_config, config.scheduler_config
    layout = worker.kv_layout
    experts_format = resolved_of(worker.config).experts_weight_format
    report = PreflightReport(
        target.name, devices[0].device_kind, len(devices), files.name,
        worker.arch.architecture, {
            "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size,
            "dtype": jax.numpy.dtype(worker.dtype).name, "quantization": worker.weight_format.quantization,
            "experts_quantization": experts_format.value if experts_format else None,
            "kv_cache": f"{layout.dtype}{' packed' if layout.packed else ''}",
            "attention_backend": worker.attention_backend, "max_model_len": worker.max_model_len,
            "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
            "block_size": cc.block_size})
    if roofline:  # before anything can fail to fit: the estimate stands either way
        try:
            report.roofline = _roofline_rows(target, worker, config)
        except ValueError as e:  # a chip the table lacks: the other figures stand
            report.roofline_error = str(e)
    options = GPU_COMPILER_OPTIONS if target.platform == "cuda" else None
    # NOTE: TPU programs compile one at a time: libtpu 0.0.42.1's SparseCore code generator
    # (v6e, tpu7x) overflowed its fibers' stacks with two compiles at once (never alone).
    threads = 1 if target.platform == "tpu" else (threads or min(4, os.cpu_count() or 1))
    # Sizing compiles the largest program of each kind (its own count) before the count of
    # every program below can start.
    try:
        report.memory = worker.plan_memory(target.memory_bytes, devices[0].device_kind, options)
    except InsufficientMemoryError as e:
        report.error = str(e)
        return report
    except Exception as e:  # noqa: BLE001 - a sizing program that does not compile
        report.error = f"a sizing program failed to compile: {' '.join(str(e).split())[:800]}"
        return report
    runner = worker.make_runner(report.memory.num_pages, abstract=True)
    programs = [p for p in runner.programs(on_first_use)
                if (kinds is None or p.kind in kinds) and (only is None or only(p))]
    m = report.memory
    progress = CompileProgress(len(programs), f"Compiling programs for {target.name}")
    for program, c in zip(programs, compile_programs(programs, options, threads, progress,
                                                     worker.sizing_compiled)):
        if isinstance(c, BaseException):
            report.programs.append(ProgramResult(program.name, program.kind, program.at_warm_up,
                                                 0.0, error=" ".join(str(c).split())[:500]))
            continue
        problems = c.problems()
        need = m.weight_bytes + m.state_bytes + m.cache_bytes + c.activation_bytes
        if need > m.memory_bytes:
            problems.append(f"needs {fmt_bytes(need)} of the device's {fmt_bytes(m.memory_bytes)}")
        report.programs.append(ProgramResult(
            c.name, c.kind, c.at_warm_up, c.compile_s, c.temp_bytes, c.activation_bytes,
            c.argument_bytes, c.alias_bytes, "; ".join(problems) or None, c.flops,
            c.bytes_accessed))
    failed = [p.name for p in report.programs if not p.ok]
    if failed:
        report.error = f"{len(failed)} program(s) failed: {', '.join(failed[:5])}"
    temps: dict[int, int] = {}  # each bucket's forward temp, beside its roofline rows
    for program, r in zip(programs, report.programs):
        if program.kind == "forward" and program.at_warm_up and r.ok:
            temps[program.bucket] = max(temps.get(program.bucket, 0), r.temp_bytes)
    report.roofline = [dataclasses.replace(r, temp_bytes=None if r.bucket is None
                                           else temps.get(r.bucket))
                       for r in report.roofline]
    # Compiled costs need the forward (--programs may leave it out); the greedy samplers are
    # compiled for them if --programs left the samplers out.
    if report.roofline and (kinds is None or ProgramKind.FORWARD in kinds):
        from jaxserve.worker.program_cost import costed_rows

        report.roofline, report.roofline_compile_s = costed_rows(
            report.roofline, worker, report.memory.num_pages, programs, report.programs,
            options, threads)
    return report


def _roofline_rows(target: Target, worker: Any, config: Any) -> list[Row]:
    """--roofline's steps for `target` with the resolved weights and KV cache."""
    import numpy as np

    from jaxserve import roofline
    from jaxserve.config import WeightFormat
    from jaxserve.worker.buckets import token_buckets

    if not target.chip:
        raise ValueError(f"--target {target.name}: a target spec file names no chip of "
                         f"jaxserve/chips.py's CHIPS table ({', '.join(CHIPS)})")
    r, sc, pc = config.resolved, config.scheduler_config, config.parallel_config
    fmt = worker.weight_format
    act = np.dtype(worker.dtype).itemsize
    # A checkpoint's own format: its values' width (XLA widens them to bf16 inside the dot).
    weight_width = (0.5 if fmt.values_dtype == "int4" else 1 if fmt.scaled
                    else 2 if fmt.bf16 else act)
    kv_width = 1 if r.kv_cache_dtype.fp8 else np.dtype(r.kv_cache_dtype.value).itemsize
    # MXFP4 experts: half a byte a value and a scale per 32.
    experts = r.experts_weight_format
    experts_width = (None if experts is None
                     else 0.5 + np.dtype(experts.scale_dtype).itemsize / 32)
    return roofline.rows(
        target.name, chip(target.chip), worker.arch, pc.tensor_parallel_size,
        "int8" if fmt is WeightFormat.INT8 else "bf16", weight_width, kv_width, act,
        sc.max_num_seqs, worker.max_model_len, token_buckets(sc.max_num_batched_tokens),
        act if fmt.from_checkpoint else None, experts_width)


def program_kinds(value: str | None) -> tuple[ProgramKind, ...] | None:
    """--programs: comma-separated kinds (ValueError naming the known ones)."""
    if not value:
        return None
    from jaxserve.worker.programs import ProgramKind

    known = [k.value for k in ProgramKind]
    unknown = [k for k in value.split(",") if k not in known]
    if unknown:
        raise ValueError(f"--programs: unknown kind(s) {unknown}; one of {', '.join(known)}")
    return tuple(ProgramKind(k) for k in value.split(","))


def target_summary(report: PreflightReport, target: Target, prices: dict[str, float]
                   ) -> dict[str, Any]:
    """One target's line of the comparison (JSON: `targets` under --roofline)."""
    from jaxserve.roofline import estimate, usd_per_million_tokens

    m = report.memory
    c1, c64 = estimate(report.roofline, 1), estimate(report.roofline, 64)
    usd = None
    if c64 is not None:  # rows exist: the target names a chip of the table
        c = chip(target.chip)
        devices = report.settings["tensor_parallel_size"] * report.settings["pipeline_parallel_size"]
        usd = usd_per_million_tokens(prices.get(c.name, c.usd_per_hour), devices, c, c64)
    return {"target": report.target, "fits": report.ok, "error": report.error,
            "roofline_error": report.roofline_error,
            "memory": report.to_json()["memory"],
            "max_concurrent_seqs": m.max_concurrent_seqs if m else None,
            "est_tokens_per_s_c1": c1, "est_tokens_per_s_c64": c64, "usd_per_m_tokens": usd,
            "compile_s": report.to_json()["compile_s"]}


def roofline_text(report: PreflightReport) -> str:
    if report.roofline_error:
        return f"roofline: {report.roofline_error}"
    lines = ["roofline: the ideal step at the chip's HBM bandwidth and matmul peak, an upper "
             "bound (jaxserve/roofline.py); compiled: what the compiled programs read and "
             "compute for the same step, against the ideal (jaxserve/worker/program_cost.py); "
             "smplr: the compiled sampler's bytes beyond the LM head, a share of the ideal step",
             f"  {'step':<8} {'batch':>5} {'context':>7} {'bucket':>6} {'pad':>4} "
             f"{'ideal MB':>9} {'GFLOP':>8} {'ms':>8} {'bound':>7} {'attn':>5} {'est tok/s':>10} "
             f"{'compiled/ideal B':>16} {'flops':>6} {'smplr':>5}"]
    if report.roofline_compile_s:
        lines.insert(1, f"  (the forward's unrolled copies, for the compiled columns, compiled in "
                        f"{report.roofline_compile_s:.1f} s)")

    def ratio(compiled: float | None, ideal: float) -> str:
        return "-" if compiled is None else f"{compiled / ideal:.2f}"

    for r in report.roofline:
        lines.append(
            f"  {r.program:<8} {r.batch:>5} {r.context:>7} {r.bucket or '-':>6} "
            f"{r.padding_share:>4.0%} {r.ideal_bytes / 1e6:>9.1f} {r.ideal_flops / 1e9:>8.1f} "
            f"{r.roofline_s * 1e3:>8.3f} {r.bound:>7} {r.attention_share:>5.0%} "
            f"{r.est_tokens_per_s:>10,.0f} {ratio(r.compiled_bytes, r.ideal_bytes):>16} "
            f"{ratio(r.compiled_flops, r.ideal_flops):>6} "
            f"{'-' if r.sampler_share is None else format(r.sampler_share, '.1%'):>5}")
    return "\n".join(lines)


def comparison_text(summaries: list[dict[str, Any]]) -> str:
    def num(v: float | None, f: str) -> str:
        return "-" if v is None else format(v, f)

    lines = ["comparison (decode at 1k tokens of context; estimates are upper bounds):",
             f"  {'target':<12} {'fits':>4} {'KV pages':>9} {'max seqs':>8} {'tok/s c1':>9} "
             f"{'tok/s c64':>10} {'$/M tok c64':>11}"]
    for t in summaries:
        m = t["memory"] or {}
        lines.append(f"  {t['target']:<12} {'yes' if t['fits'] else 'no':>4} "
                     f"{num(m.get('num_pages'), ','):>9} {num(t['max_concurrent_seqs'], ','):>8} "
                     f"{num(t['est_tokens_per_s_c1'], ',.0f'):>9} "
                     f"{num(t['est_tokens_per_s_c64'], ',.0f'):>10} "
                     f"{num(t['usd_per_m_tokens'], '.3f'):>11}")
        why = t["error"] or t["roofline_error"]
        if why:
            lines.append(f"  {'':<12} {why[:200]}")
    return "\n".join(lines)


def log_to_stderr() -> None:
    """jaxserve's log lines (the compile progress: worker/compile_progress.py) and any
    warnings on stderr; stdout holds the report alone (one JSON object with --json)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if logging.getLogger("jaxserve").level == logging.NOTSET:  # not set by a caller (a test's)
        logging.getLogger("jaxserve").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    # The runtime backend does not matter here (the devices are compile-only); the CPU's
    # starts at once, where probing for a GPU or TPU runtime prints errors or waits.
    select_jax_platforms(cpu_only=True)
    log_to_stderr()
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        targets, config, files, arch = validate(args)
        kinds = program_kinds(args.programs)
        prices = parse_prices(args.price)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    reports = []
    for target in targets:  # one after another; one target's failure hides no other's
        try:
            report = run_preflight(config, target, files, on_first_use=not args.only_warm_up,
                                   threads=args.compile_threads, kinds=kinds,
                                   roofline=args.roofline)
        except ValueError as e:  # e.g. more devices asked for than the topology has
            if len(targets) == 1:
                parser.error(str(e))
            report = PreflightReport(target.name, "", 0, files.name, arch.architecture, {},
                                     error=str(e))
        reports.append(report)
    summaries = [target_summary(r, t, prices) for r, t in zip(reports, targets)] if args.roofline else []
    if args.json:
        out: Any = ({"targets": summaries,
                     "rows": [{**dataclasses.asdict(r), "sampler_share": r.sampler_share}
                              for rep in reports for r in rep.roofline]}
                    if args.roofline else reports[0].to_json() if len(reports) == 1
                    else [r.to_json() for r in reports])
        print(json.dumps(out, indent=1))
    else:
        texts = [r.to_text() + ("\n" + roofline_text(r) if args.roofline else "") for r in reports]
        if len(reports) > 1 and args.roofline:
            texts.append(comparison_text(summaries))
        print("\n\n".join(texts))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
