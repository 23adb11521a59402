#!/usr/bin/env bash
# Start real SGLang engines, the router (smg) and kvproxy on one GPU host.
# Not run in CI (needs GPUs and `pip install -e '.[sglang]'`).
#
#   MODEL=Qwen/Qwen3-8B NUM_ENGINES=2 TP=1 scripts/launch_stack.sh [kvproxy serve flags...]
#
# Engines get ports 31001.., the router 30000 (Prometheus 29000), kvproxy 8100.
#
# The deployment contract (docs/operations.md#deployment-contract):
#   smg     --policy consistent_hashing --disable-worker-overload-protection
#           (kvproxy mirrors the ring; smg's overload protection would move requests off
#           their ring engine, and kvproxy's admission does that job instead)
#   engines --enable-session-radix-cache --radix-eviction-policy priority
#           --enable-priority-scheduling --enable-metrics
#   kvproxy --router-policy consistent_hashing (router.policy), routing key = session id
# ROUTER_POLICY / ROUTER_POLICY_ARGS replace the router's policy flags (kvproxy is told
# the policy; with one it cannot mirror, program admission falls back to fleet-wide).
# Ctrl-C stops everything this script started (by PID).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${MODEL:?set MODEL to a HuggingFace id or local path}"
NUM_ENGINES="${NUM_ENGINES:-2}"
TP="${TP:-1}"
ENGINE_BASE_PORT="${ENGINE_BASE_PORT:-31001}"
ROUTER_PORT="${ROUTER_PORT:-30000}"
ROUTER_METRICS_PORT="${ROUTER_METRICS_PORT:-29000}"
PROXY_PORT="${PROXY_PORT:-8100}"
CONFIG="${CONFIG:-configs/kvproxy.yaml}"
PY="${PY:-.venv/bin/python}"
ROUTER_POLICY="${ROUTER_POLICY:-consistent_hashing}"
ROUTER_POLICY_ARGS="${ROUTER_POLICY_ARGS:---policy $ROUTER_POLICY --disable-worker-overload-protection}"
LOGS="${LOGS:-results/stack-logs}"
mkdir -p "$LOGS"

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

wait_http() {  # url, tries
    for _ in $(seq 1 "$2"); do
        if curl -fsS -o /dev/null "$1"; then return 0; fi
        sleep 2
    done
    echo "timed out waiting for $1" >&2
    return 1
}

workers=()
for i in $(seq 0 $((NUM_ENGINES - 1))); do
    port=$((ENGINE_BASE_PORT + i))
    gpus=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
    # What kvproxy assumes: session radix cache with priority eviction, priorities
    # honoured (request priorities reach radix eviction only with priority scheduling on).
    SGLANG_ENABLE_UNIFIED_RADIX_TREE=1 CUDA_VISIBLE_DEVICES="$gpus" \
        "$PY" -m sglang.launch_server --model-path "$MODEL" --tp "$TP" \
        --host 127.0.0.1 --port "$port" \
        --enable-metrics --enable-session-radix-cache --radix-eviction-policy priority \
        --enable-priority-scheduling \
        >"$LOGS/engine-$port.log" 2>&1 &
    pids+=($!)
    workers+=("http://127.0.0.1:$port")
done
for w in "${workers[@]}"; do wait_http "$w/health" 600; done

"$PY" -m smg launch --host 127.0.0.1 --port "$ROUTER_PORT" \
    --prometheus-host 127.0.0.1 --prometheus-port "$ROUTER_METRICS_PORT" \
    --worker-urls "${workers[@]}" $ROUTER_POLICY_ARGS --disable-circuit-breaker \
    >"$LOGS/router.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$ROUTER_PORT/readiness" 120

"$PY" -m kvproxy serve --config "$CONFIG" --port "$PROXY_PORT" \
    --router-url "http://127.0.0.1:$ROUTER_PORT" --router-policy "$ROUTER_POLICY" "$@" >"$LOGS/kvproxy.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$PROXY_PORT/kvproxy/health" 60

echo "kvproxy ready at http://127.0.0.1:$PROXY_PORT (router :$ROUTER_PORT, engines ${workers[*]}); logs in $LOGS"
wait
