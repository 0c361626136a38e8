#!/usr/bin/env bash
# The main job on a fresh machine: install chunkledger into .venv, start the ledger on the embedded
# DuckDB file, feed it a simulated fleet (4 engines + a gateway, the long-prompt scene) through the
# real exporter, then show what the ledger recorded. The ledger keeps serving until Ctrl-C when run
# from a terminal (DEMO_KEEP=0 to exit at the end).
#
#   DEMO_DURATION=20 CHUNKLEDGER_PORT=8321 CHUNKLEDGER_DB_URL=duckdb:///./chunkledger.duckdb scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PORT=${CHUNKLEDGER_PORT:-8321}
DB=${CHUNKLEDGER_DB_URL:-duckdb:///./chunkledger.duckdb}
DURATION=${DEMO_DURATION:-20}
KEEP=${DEMO_KEEP:-$([ -t 1 ] && echo 1 || echo 0)}
URL="http://127.0.0.1:${PORT}"

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[postgres]'

.venv/bin/chunkledger serve --db "$DB" --port "$PORT" > .chunkledger-demo.log 2>&1 &
LEDGER=$!
trap 'kill "$LEDGER" 2>/dev/null || true; wait "$LEDGER" 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  if .venv/bin/python -c "import httpx,sys; sys.exit(httpx.get('$URL/readyz').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 "$LEDGER" 2>/dev/null || { cat .chunkledger-demo.log; exit 1; }
  sleep 0.2
done
echo "ledger ready: $URL  (OpenAPI docs: $URL/docs, database: $DB)"

PREFIX="demo-$(date +%s)"
echo "simulating 4 engines + 1 gateway for ${DURATION}s (scenario long-prompts, source prefix $PREFIX) ..."
.venv/bin/chunkledger simulate --engines 4 --rps 20 --duration "$DURATION" --ledger "$URL" \
  --scenario long-prompts --seed 7 --source-prefix "$PREFIX" | tee .chunkledger-demo-sim.json

.venv/bin/python - "$URL" "$PREFIX" <<'PY'
import sys, httpx
url, prefix = sys.argv[1], sys.argv[2]
sources = [s for s in httpx.get(f"{url}/v1/sources").json()["sources"] if s["source_id"].startswith(prefix)]
print(f"\n{'source':<28}{'kind':<9}{'events':>9}{'last seq':>20}{'dropped':>9}")
for s in sources:
    print(f"{s['source_id']:<28}{s['kind']:<9}{s['events_total']:>9}{s['last_seq']:>20}{s['dropped_total']:>9}")
rid = f"{prefix}-7-req-0000001"
doc = httpx.get(f"{url}/v1/requests/{rid}").json()
r = doc["request"]
print(f"\nrequest {rid}: prompt {r['prompt_tokens']} tokens, {r['chunks']} chunks, "
      f"{r['preemptions']} preemptions, {r['output_tokens']} output tokens, finish {r['finish_reason']}")
for e in doc["events"][:12]:
    extra = {k: v for k, v in e.items() if k not in ("source_id", "seq", "ts", "kind")}
    print(f"  {e['ts']:.3f}  {e['source_id']:<22} {e['kind']:<20} {extra}")
print(f"  ... {len(doc['events'])} events in all: GET {url}/v1/requests/{rid}")
PY

if [ "$KEEP" = "1" ]; then
  echo "ledger still serving on $URL; Ctrl-C to stop"
  wait "$LEDGER"
fi
