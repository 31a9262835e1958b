#!/usr/bin/env bash
# The adapters' decode-step overhead on a GPU, on the real servers: SGLang, then vLLM, each
# serving a small model unguarded and then under `kvguard run` (a capture sink, enforce
# mode), the same workload each time, in one run. Prints one line per engine and run and
# the ratio. Needs a CUDA host where `python -m sglang.launch_server` and `vllm serve` work
# in the current environment, kvguard installed there, and the model on local disk.
# Usage: bench/engines_gpu.sh MODEL_DIR [REQUESTS=64] [MAX_TOKENS=256]
set -euo pipefail
MODEL=${1:?model directory}; N=${2:-64}; TOKENS=${3:-256}; PORT=30123
OUT=${OUT:-/tmp/kvguard-engines-gpu}; mkdir -p "$OUT"

serve_and_time() {  # label, then the server command; prints "label: decode tokens/s"
    local label=$1; shift
    "$@" > "$OUT/$label.log" 2>&1 & local pid=$!
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
    python3 - "$label" "$PORT" "$N" "$TOKENS" <<'PY'
import concurrent.futures, json, sys, time, urllib.request
label, port, n, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
def one(i):
    body = json.dumps({"model": model, "prompt": f"tenant {i % 4}: " + "lorem ipsum " * 200,
                       "max_tokens": tokens, "ignore_eos": True, "cache_salt": f"t{i % 4}"}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["usage"]["completion_tokens"]
start = time.perf_counter()
with concurrent.futures.ThreadPoolExecutor(n) as pool:
    done = sum(pool.map(one, range(n)))
print(f"{label}: {done / (time.perf_counter() - start):.0f} decode tokens/s ({done} tokens, {n} requests)")
PY
    kill "$pid"; wait "$pid" 2>/dev/null || true
}

for engine in sglang vllm; do
    if [ "$engine" = sglang ]; then
        cmd=(python -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --page-size 16)
    else
        cmd=(vllm serve "$MODEL" --port "$PORT" --block-size 16)
    fi
    plain=$(serve_and_time "$engine-unguarded" "${cmd[@]}")
    guarded=$(serve_and_time "$engine-guarded" kvguard run --node "bench-$engine" --capture "$OUT/$engine.jsonl" -- "${cmd[@]}")
    echo "$plain"; echo "$guarded"
    python3 -c "import sys; a, b = (float(s.split(': ')[1].split()[0]) for s in sys.argv[1:]); \
print(f'$engine: kvguard costs {1 - b / a:.1%} of decode throughput')" "$plain" "$guarded"
done
