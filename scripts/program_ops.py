"""Where a compiled program's bytes are: compile one engine program for a target and list its
largest ops (the entry computation's, summed by opcode and shape), with XLA's cost analysis.

    python scripts/program_ops.py --target v6e:1x1 --program "sample[R=16, greedy]" \
        --max-num-seqs 16 --max-model-len 1024 --num-gpu-blocks-override 1024 [--unrolled]

Any preflight/engine flag is taken (the model positionally or as --model; default: the default
model). `--unrolled` compiles the forward's layers unrolled (the copy `--roofline` costs on TPU).
docs/benchmarks.md ("Compiled bytes against the ideal") has what it showed.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s4": 0.5,
          "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in an HLO result type (a tuple sums its elements)."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


def main() -> None:
    import jax

    from jaxserve.engine.resolve import resolve_engine_config
    from jaxserve.preflight import make_parser, validate
    from jaxserve.worker.programs import cost_analysis, without_persistent_cache
    from jaxserve.worker.targets import make_devices
    from jaxserve.worker.worker import Worker

    argv = sys.argv[1:]
    unrolled = "--unrolled" in argv
    argv = [a for a in argv if a != "--unrolled"]
    i = argv.index("--program")
    name = argv[i + 1]
    del argv[i:i + 2]
    targets, config, files, arch = validate(make_parser().parse_args(argv))
    pc = config.parallel_config
    devices = make_devices(targets[0], pc.tensor_parallel_size * pc.pipeline_parallel_size)
    config = resolve_engine_config(config, files, devices)
    worker = Worker(config, files, devices=devices)
    if unrolled:
        worker.model_options = dataclasses.replace(worker.model_options,
                                                   layer_unroll=arch.num_hidden_layers)
    worker.load_abstract_model()
    pages = config.cache_config.num_gpu_blocks_override or 1024
    runner = worker.make_runner(pages, abstract=True)
    programs = {p.name: p for p in runner.programs()}
    if name not in programs:
        raise SystemExit(f"no program {name!r}; the runner has: {', '.join(programs)}")
    p = programs[name]
    with without_persistent_cache(), jax.set_mesh(p.mesh):
        compiled = p.fn.trace(*p.args).lower().compile()
    flops, nbytes = cost_analysis(compiled)
    print(f"{name} on {targets[0].name}{' (unrolled)' if unrolled else ''}: XLA's cost analysis: "
          f"{flops} flops, {nbytes} bytes accessed")
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    sizes: collections.Counter[tuple[str, str]] = collections.Counter()
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\S+) ([\w\-]+)\(", line)
        if m:
            key = (m.group(2), m.group(1)[:70])
            sizes[key] += shape_bytes(m.group(1))
            counts[key] += 1
    print(f"{'result MB':>10} {'ops':>4}  opcode, result type")
    for key, size in sizes.most_common(30):
        print(f"{size / 1e6:>10.1f} {counts[key]:>4}  {key[0]}, {key[1]}")


if __name__ == "__main__":
    main()
