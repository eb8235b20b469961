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
import os
import sys
from typing import TYPE_CHECKING, Any

from jaxserve.models.model_files import ModelFiles, resolve_model
from jaxserve.platforms import select_jax_platforms
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.serve import engine_arg_parser, engine_config_from_args
from jaxserve.worker.kv_sizing import InsufficientMemoryError, MemoryPlan, fmt_bytes
from jaxserve.worker.targets import Target, parse_target, supported_targets

if TYPE_CHECKING:
    from jaxserve.worker.programs import ProgramKind

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
            "kv_cache_bytes": m.cache_bytes, "kv_bytes_per_token": m.page_bytes // m.page_size,
            "num_pages": m.num_pages, "page_size": m.page_size, "max_model_len": m.max_model_len,
            "max_concurrent_seqs": m.max_concurrent_seqs}
        return {
            "ok": self.ok, "error": self.error, "target": self.target, "device": self.device,
            "num_devices": self.num_devices, "model": self.model,
            "architecture": self.architecture, "settings": self.settings, "memory": memory,
            "compile_s": {"warm_up": round(self.compile_seconds(True), 2),
                          "first_use": round(self.compile_seconds(False), 2),
                          "total": round(self.compile_seconds(), 2)},
            "programs": [dataclasses.asdict(p) for p in self.programs],
        }

    def to_text(self) -> str:
        s = self.settings
        lines = [f"jaxserve preflight: {self.model} ({self.architecture}) on {self.target} "
                 f"({self.device} x {self.num_devices}): tp={s['tensor_parallel_size']} "
                 f"pp={s['pipeline_parallel_size']}, {s['dtype']} weights"
                 f"{' (' + s['quantization'] + ')' if s['quantization'] else ''}, KV cache {s['kv_cache']}, "
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
                f"{m.page_size} tokens, {fmt_bytes(m.page_bytes // m.page_size)} per token",
                f"  -> {m.max_concurrent_seqs} sequences of {m.max_model_len} tokens at once"]
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
    g.add_argument("--target", required=True,
                   help=f"the device to compile for: {supported_targets()}")
    g.add_argument("--json", action="store_true", help="print the report as one JSON object")
    g.add_argument("--only-warm-up", action="store_true",
                   help="compile only warm-up's programs, not the first-use variants")
    g.add_argument("--programs", default=None, metavar="KINDS",
                   help="only these kinds of programs, comma-separated (forward, sample, "
                        "verify, prompt_logprobs, pool, admit); default: all")
    g.add_argument("--compile-threads", type=int, default=None,
                   help="GPU targets: compiles at once (default: one per CPU core, at most 4); "
                        "TPU programs always compile one at a time")
    EngineArgs.add_cli_args(p)
    return p


def validate(args: argparse.Namespace) -> tuple[Target, Any, ModelFiles, Any]:
    """Everything checkable without JAX (fast): the target, the flags, the model's
    architecture. Raises ValueError / FileNotFoundError with the message to show."""
    for name in ("model", "model_tag"):  # config.json alone: its folder (no weights needed)
        path = getattr(args, name)
        if path and os.path.basename(path) == "config.json":
            setattr(args, name, os.path.dirname(os.path.abspath(path)))
    target = parse_target(args.target)
    config = engine_config_from_args(args)
    files = resolve_model(config.model_config.model)
    from jaxserve.models.loaders import read_arch  # HF: config.json only, no JAX

    return target, config, files, read_arch(files)


def run_preflight(config: Any, target: Target, files: ModelFiles, on_first_use: bool = True,
                  threads: int | None = None, kinds: tuple[ProgramKind, ...] | None = None
                  ) -> PreflightReport:
    """Size the cache and compile every program for `target` (the JAX part); `threads`
    compiles at once for a GPU (default: one per CPU core, at most 4); `kinds` keeps only
    programs of those kinds ("forward", "sample", ...)."""
    from jaxserve.worker.programs import without_persistent_cache

    with without_persistent_cache():
        return _run(config, target, files, on_first_use, threads, kinds)


def _run(config: Any, target: Target, files: ModelFiles, on_first_use: bool,
         threads: int | None, kinds: tuple[ProgramKind, ...] | None) -> PreflightReport:
    import jax

    from jaxserve.engine.resolve import resolve_engine_config
    from jaxserve.worker.programs import compile_programs
    from jaxserve.worker.targets import make_devices
    from jaxserve.worker.worker import Worker

    pc = config.parallel_config
    devices = make_devices(target, pc.tensor_parallel_size * pc.pipeline_parallel_size)
    config = resolve_engine_config(config, files, devices)
    worker = Worker(config, files, devices=devices)
    worker.load_abstract_model()
    cc, sc = config.cache_config, config.scheduler_config
    layout = worker.kv_layout
    report = PreflightReport(
        target.name, devices[0].device_kind, len(devices), files.name,
        worker.arch.architecture, {
            "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size,
            "dtype": jax.numpy.dtype(worker.dtype).name, "quantization": worker.weight_format.quantization,
            "kv_cache": f"{layout.dtype}{' packed' if layout.packed else ''}",
            "attention_backend": worker.attention_backend, "max_model_len": worker.max_model_len,
            "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
            "block_size": cc.block_size})
    options = GPU_COMPILER_OPTIONS if target.platform == "cuda" else None
    # NOTE: TPU programs compile one at a time: libtpu 0.0.42.1's SparseCore code generator
    # (v6e, tpu7x) overflowed its fibers' stacks with two compiles at once (never alone).
    threads = 1 if target.platform == "tpu" else (threads or min(4, os.cpu_count() or 1))
    try:
        report.memory = worker.plan_memory(target.memory_bytes, devices[0].device_kind, options)
    except InsufficientMemoryError as e:
        report.error = str(e)
        return report
    except Exception as e:  # noqa: BLE001 - a sizing program that does not compile
        report.error = f"a sizing program failed to compile: {' '.join(str(e).split())[:800]}"
        return report
    runner = worker.make_runner(report.memory.num_pages, abstract=True)
    programs = [p for p in runner.programs(on_first_use) if kinds is None or p.kind in kinds]
    m = report.memory
    for program, c in zip(programs, compile_programs(programs, options, threads)):
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
            c.argument_bytes, c.alias_bytes, "; ".join(problems) or None))
    failed = [p.name for p in report.programs if not p.ok]
    if failed:
        report.error = f"{len(failed)} program(s) failed: {', '.join(failed[:5])}"
    return report


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


def main(argv: list[str] | None = None) -> int:
    # The runtime backend does not matter here (the devices are compile-only); the CPU's
    # starts at once, where probing for a GPU or TPU runtime prints errors or waits.
    select_jax_platforms(cpu_only=True)
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        target, config, files, _ = validate(args)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    try:
        kinds = program_kinds(args.programs)
        report = run_preflight(config, target, files, on_first_use=not args.only_warm_up,
                               threads=args.compile_threads, kinds=kinds)
    except ValueError as e:  # e.g. more devices asked for than the topology has
        parser.error(str(e))
    print(json.dumps(report.to_json(), indent=1) if args.json else report.to_text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
