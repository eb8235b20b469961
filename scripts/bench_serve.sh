#!/usr/bin/env bash
# Online benchmark of the default model: start `python -m jaxserve.serve`, run
# `python -m jaxserve.bench serve` at concurrency 1, 8, 32 and 64 (32-token prompts,
# 256-token outputs, ignore_eos), print one summary line per run, stop the server.
#   bash scripts/bench_serve.sh [OUT_DIR]        (JSON results in OUT_DIR, default /tmp/jaxserve-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/jaxserve-bench}
PORT=${PORT:-8123}
mkdir -p "$OUT"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# The same engine settings as `python -m jaxserve.bench throughput` (the offline peer).
python -m jaxserve.serve --port "$PORT" --max-model-len 2048 --max-num-seqs 64 \
    --max-num-batched-tokens 512 --disable-uvicorn-access-log >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 1
done
for C in 1 8 32 64; do
    N=$(( C == 1 ? 2 : 2 * C ))
    python -m jaxserve.bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts "$N" \
        --max-concurrency "$C" --random-input-len 32 --random-output-len 256 --seed 0 \
        --output-json "$OUT/serve_c$C.json" >"$OUT/serve_c$C.txt"
    python - "$OUT/serve_c$C.json" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"concurrency {m['max_concurrency']:>3}  prompts {m['num_prompts']:>4}  failed {m['failed']}  "
      f"req/s {m['request_throughput']:.3f}  out tok/s {m['output_throughput']:.1f}  "
      f"TTFT mean/med/p99 {m['mean_ttft_ms']:.0f}/{m['median_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms  "
      f"TPOT {m['mean_tpot_ms']:.1f}/{m['median_tpot_ms']:.1f}/{m['p99_tpot_ms']:.1f} ms  "
      f"ITL {m['mean_itl_ms']:.1f}/{m['median_itl_ms']:.1f}/{m['p99_itl_ms']:.1f} ms  "
      f"E2EL {m['mean_e2el_ms']:.0f}/{m['median_e2el_ms']:.0f}/{m['p99_e2el_ms']:.0f} ms")
EOF
done
