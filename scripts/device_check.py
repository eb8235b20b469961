"""The checks only a real GPU or TPU can make, in one run of a few minutes.

    bash scripts/device_check.sh            # on the lent machine; a table on stdout and,
                                            # where $OUT is set, in $OUT/device_check.md
    python scripts/device_check.py --smoke  # anywhere: tiny sizes, interpret mode (stays tested)

1. Kernels on the device, not interpreted: the platform's attention kernel (gpu or tpu) and its
   KV write against the jax.numpy reference over NaN-poisoned ragged batches (bf16 and fp8
   caches, GQA groups 1/4/8, head dims 64/128, pages of 16/32, sliding window, soft cap).
2. The engine on random Llama-3-8B-shaped weights (--load-format dummy, a config.json alone):
   start-up (KV-cache sizing from the compiler), one request (TTFT and TPOT at a 512-token
   prompt), 64 at once (output tokens/s), then decode steps at batch 1, 16 and 64 with 1k of
   context and 16 with 8k, each timed beside its roofline (jaxserve/roofline.py) on the chip
   jaxserve/chips.py names for the device: the measured fraction of the upper bound.
3. The kernel benchmark (scripts/bench_kernels.py): % of HBM bandwidth, and JAX's own paged
   attention beside ours where JAX has one.

Each stage reports as it ends and a failing stage keeps the others' results. A machine with
no package registry: `bash scripts/device_wheels.sh` here, carry .whl/ (device_check.sh
installs it). One run took about two minutes on an H200 (docs/benchmarks.md).

The device compiles (Mosaic, Triton, ptxas, memory) are checked without a device in CI
(tests/device_compile); this covers what a compiler cannot: numerics on the chip, races, speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from batches import make_batch, tolerance  # noqa: E402  (tests/kernels/batches.py)

import kernels_pallas  # noqa: E402
from kernels_pallas.kv_cache import KVCacheLayout, convert_cache  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                 max_position_embeddings=8192)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
SEQS = [(1, 300), (37, 37), (1, 1), (128, 700), (5, 65), (1, 33)]
KERNEL_CASES = [  # (q heads, kv heads), head dim, page size, cache values, options
    ((32, 8), 128, 16, "bfloat16", {}), ((32, 8), 128, 16, "fp8_e4m3", {}),
    ((8, 8), 128, 32, "bfloat16", {"sliding_window": 100}), ((9, 3), 64, 16, "bfloat16", {}),
    ((16, 2), 64, 32, "fp8_e4m3", {"soft_cap": 30.0}), ((8, 1), 128, 16, "bfloat16", {}),
]


def check_kernels(backend: str, interpret: bool) -> list[dict]:
    """The backend's attention and KV write on the device against the reference."""
    rows = []
    ref = jax.jit(kernels_pallas.ragged_paged_attention, static_argnames=("spec",))
    packed = kernels_pallas.get_backend(backend).packed_layout
    for (hq, hkv), d, page, dtype, opts in KERNEL_CASES:
        b = make_batch(SEQS, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, seed=hkv)
        std = KVCacheLayout(hkv, d, dtype)
        values = jnp.asarray(b.kv_pages).astype(std.value_dtype)
        stored = jax.lax.bitcast_convert_type(values, jnp.uint8) if std.is_fp8 else values
        layout = dataclasses.replace(std, packed=packed)
        cache = convert_cache(stored, std, layout) if packed else stored
        q = jnp.asarray(b.q, jnp.bfloat16)
        scales = dict(k_scale=0.5, v_scale=2.0) if std.is_fp8 else {}
        spec = kernels_pallas.AttentionSpec(sm_scale=d ** -0.5, **opts, **scales)
        fn = jax.jit(lambda *a: kernels_pallas.ragged_paged_attention(
            *a, spec=dataclasses.replace(spec, layout=layout), backend=backend,
            interpret=interpret))
        got = fn(q, cache, *b.args[2:])
        want = ref(q, stored, *b.args[2:], spec=dataclasses.replace(spec, layout=std))  # the reference
        n = b.num_real_tokens
        err = float(jnp.max(jnp.abs(got[:n].astype(jnp.float32) - want[:n].astype(jnp.float32))))
        ok = bool(jnp.isfinite(got[:n].astype(jnp.float32)).all()) and np.allclose(
            np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32),
            **tolerance(jnp.bfloat16))
        # The KV write: three tokens into known slots, read back through the layout.
        k = jnp.asarray(np.random.default_rng(0).standard_normal((3, hkv, d)), jnp.bfloat16)
        slots = jnp.asarray([page + 1, 2 * page + 3, 0], jnp.int32)
        written = kernels_pallas.update_kv_cache(cache, k, k, slots, backend=backend,
                                                 interpret=interpret, layout=layout)
        back = layout.unpack(written.reshape(-1, *layout.token_shape)[slots[:2]])
        write_ok = bool(jnp.array_equal(back, layout.unpack(layout.pack(k, k))[:2]))
        rows.append(dict(case=f"g{hq // hkv} kvh{hkv} d{d} p{page} {dtype} {opts or ''}",
                         max_err=err, attention_ok=ok, kv_write_ok=write_ok))
    return rows


def write_dummy_model(path: Path, arch: dict) -> None:
    """config.json for --load-format dummy, and a word-level tokenizer over its vocabulary
    (t0, t1, ...: nothing downloaded, any sampled id decodes)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **arch).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(arch["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)


def check_engine(arch: dict, smoke: bool) -> tuple[dict, list[dict]]:
    """Start-up, one request and a batch of 64, then the decode steps against the roofline."""
    from jaxserve import LLM, SamplingParams

    path = Path(tempfile.mkdtemp(prefix="dummy_model_"))
    write_dummy_model(path, arch)
    prompt_len, out_len, batch = (32, 16, 8) if smoke else (512, 128, 64)
    t0 = time.perf_counter()
    # enforce_eager: programs compile on first use, not all at start-up (the lease is short;
    # every timed window below starts after its programs compiled).
    llm = LLM(str(path), load_format="dummy", max_model_len=1024 if smoke else 8192,
              max_num_seqs=batch, max_num_batched_tokens=128 if smoke else 2048,
              enforce_eager=True)
    startup = time.perf_counter() - t0
    worker = llm.engine.worker
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompt = lambda: {"prompt_token_ids": rng.integers(2, arch["vocab_size"], prompt_len).tolist()}  # noqa: E731
    for warm in (params, dataclasses.replace(params, max_tokens=1)):  # first-use compiles
        llm.generate([prompt()], warm, use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt()], dataclasses.replace(params, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt()], params, use_tqdm=False)
    single = time.perf_counter() - t
    llm.generate([prompt() for _ in range(batch)], params, use_tqdm=False)  # compiles its buckets
    t = time.perf_counter()
    many = llm.generate([prompt() for _ in range(batch)], params, use_tqdm=False)
    wall = time.perf_counter() - t
    plan = worker.memory_plan
    result = dict(
        device=jax.devices()[0].device_kind, startup_s=round(startup, 1),
        kv_cache=plan.summary() if plan else f"{worker.num_blocks} pages (CPU budget)",
        prompt_tokens=prompt_len, output_tokens=out_len, ttft_ms=round(1e3 * ttft, 1),
        tpot_ms=round(1e3 * (single - ttft) / (out_len - 1), 2), batch=batch,
        batch_out_tokens_per_s=round(sum(len(o.outputs[0].token_ids) for o in many) / wall, 1))
    cases = [(1, 64), (4, 64)] if smoke else [(1, 1024), (16, 1024), (64, 1024), (16, 7936)]
    steps = [decode_vs_roofline(llm, b, c, arch["vocab_size"]) for b, c in cases]
    llm.shutdown()
    return result, steps


def decode_step_s(llm: Any, batch: int, context: int, vocab: int, window: int = 24) -> float:
    """Seconds per engine step while `batch` sequences of about `context` tokens all decode:
    the steps after every prompt has its first token (two skipped: a bucket's first use
    compiles) and before the first sequence ends. Host time between steps included."""
    from jaxserve import SamplingParams

    sc = llm.config.scheduler_config
    prefill_steps = -(-batch * context // sc.max_num_batched_tokens) + 1
    params = SamplingParams(max_tokens=prefill_steps + window + 4, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(batch + context)
    for _ in range(batch):
        llm._add_request({"prompt_token_ids": rng.integers(2, vocab, context).tolist()}, params, 0)
    core, seen, full_steps, emitted = llm.engine_core, set(), 0, 0
    t0 = t1 = 0.0
    while core.has_work():
        outputs = core.step_fn() or []
        now = time.perf_counter()
        llm.output_processor.process_outputs(outputs)
        if any(o.finish_reason is not None for o in outputs):
            full_steps = -1  # the batch shrinks from here: the window is over
        elif len(seen) == batch and full_steps >= 0:
            full_steps += 1
            if full_steps == 3:
                t0 = now
            elif full_steps > 3:
                emitted, t1 = emitted + sum(len(o.new_token_ids) for o in outputs), now
        seen.update(o.req_id for o in outputs if o.new_token_ids)
    if emitted < batch:
        raise RuntimeError(f"decode batch {batch} at {context}: no full-batch window was timed")
    return (t1 - t0) / (emitted / batch)


def decode_vs_roofline(llm: Any, batch: int, context: int, vocab: int) -> dict:
    """The measured decode step beside the roofline's (jaxserve/roofline.py) on this chip."""
    from jaxserve import chips, roofline

    worker = llm.engine.worker
    measured = decode_step_s(llm, batch, context, vocab)
    chip = chips.chip_for_device(jax.devices()[0].device_kind)
    step = roofline.decode(batch, context)
    width = np.dtype(worker.dtype).itemsize
    kv = llm.config.resolved.kv_cache_dtype
    ideal = roofline.ideal_step(worker.arch, step, width,
                                1 if kv.fp8 else np.dtype(kv.value).itemsize, width)
    row = dict(batch=batch, context=context, step_ms=round(1e3 * measured, 3),
               tokens_per_s=round(batch / measured, 1), ideal_mb=round(ideal.bytes / 1e6, 1),
               achieved_gb_s=round(ideal.bytes / measured / 1e9, 1))
    if chip is not None and chip.hbm_bytes_per_s:
        line = roofline.roofline(chip, ideal, step, chip.devices_per_chip, "bf16")
        row.update(chip=chip.name, roofline_ms=round(1e3 * line.seconds, 3),
                   roofline_tokens_per_s=round(line.tokens_per_s, 1),
                   of_roofline=round(line.seconds / measured, 3))
    return row


def decode_table(rows: list[dict]) -> list[str]:
    out = ["| batch | context | measured step | tok/s | roofline step | roofline tok/s | "
           "measured / roofline speed | ideal bytes | achieved |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['context']} | {r['step_ms']} ms | {r['tokens_per_s']} | "
                   f"{r.get('roofline_ms', '-')} ms | {r.get('roofline_tokens_per_s', '-')} | "
                   f"{r.get('of_roofline', '-')} | {r['ideal_mb']} MB | {r['achieved_gb_s']} GB/s |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; interpret mode off-device")
    p.add_argument("--bench-timeout", type=float, default=240.0,
                   help="seconds for the kernel benchmark (it runs last)")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    platform = {"gpu": "cuda"}.get(device.platform, device.platform)
    on_device = platform in kernels_pallas.PLATFORM_BACKENDS and platform != "cpu"
    backend = kernels_pallas.PLATFORM_BACKENDS.get(platform, "tpu") if on_device else "tpu"
    smoke = args.smoke or not on_device
    lines = [f"# device check: {device.device_kind} ({platform}), jax {jax.__version__}, "
             f"Python {sys.version.split()[0]}", ""]
    if not on_device:
        lines.append("(no GPU/TPU: smoke run, kernels interpreted; the figures mean nothing)")
    failed: list[str] = []

    def emit(more: list[str]) -> None:  # each stage's lines as soon as it ends (a lease is short)
        lines.extend(more)
        print("\n".join(more), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "device_check.md").write_text("\n".join(lines) + "\n")

    def stage(name: str, fn: Any) -> None:  # one stage's failure keeps the others' results
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported in the table, the run goes on
            import traceback
            failed.append(name)
            emit(["", f"## {name}: FAILED", "", "```", traceback.format_exc()[-3000:], "```"])
        print(f"({name}: {time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)

    def kernels() -> None:
        rows = check_kernels(backend, interpret=not on_device)
        emit(["## kernels on the device", "", "| case | max err | attention | KV write |",
              "|---|---:|---|---|"] +
             [f"| {r['case']} | {r['max_err']:.2e} | {'ok' if r['attention_ok'] else 'FAIL'} | "
              f"{'ok' if r['kv_write_ok'] else 'FAIL'} |" for r in rows])
        if any(not (r["attention_ok"] and r["kv_write_ok"]) for r in rows):
            failed.append("kernels")

    def engine() -> None:
        result, steps = check_engine(TINY if smoke else LLAMA3_8B, smoke)
        emit(["", "## engine, tiny random weights" if smoke else
              "## engine, random Llama-3-8B-shaped weights", "", "```",
              json.dumps(result, indent=1), "```", "",
              "### decode steps against the roofline (jaxserve/roofline.py; upper bound)", ""]
             + decode_table(steps))

    def bench() -> None:
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"),
                              *(["--smoke"] if smoke else [])],
                             capture_output=True, text=True, timeout=args.bench_timeout)
        emit(["", "## kernel benchmark (scripts/bench_kernels.py)", "", "```",
              run.stdout.strip() or run.stderr[-2000:], "```"])
        if run.returncode:
            failed.append("bench")

    stage("kernels", kernels)
    stage("engine", engine)
    stage("kernel benchmark", bench)
    if failed:
        emit(["", f"failed: {', '.join(failed)}"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
