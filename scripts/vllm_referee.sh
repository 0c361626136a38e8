#!/usr/bin/env bash
# vLLM's own scheduler tests (tests/v1/core of VERSION's sdist) with chunkledger's scheduler classes in
# vLLM's place, the hooks on and reporting to a real ledger (tests/vllm_referee/referee_plugin.py says
# how). A test of vLLM's that passes with vLLM's classes on this host must pass with the plugin's.
#
#   scripts/vllm_referee.sh VERSION [pytest args]      e.g. scripts/vllm_referee.sh 0.34.0
#   scripts/vllm_referee.sh VERSION --record            # the baseline: vLLM's own classes, whose
#                                                         failures go to tests/vllm_referee/baseline-VERSION.txt
#
# Deselected: the baseline's tests, which fail on this host with vLLM's own classes too: the multimodal
# ones (the Llava config they build cannot be inspected without torchvision, which cannot load beside
# the CPU torch) and 0.32's pipeline-parallel async test (Model Runner V2, so Triton). Exits with
# pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: $0 VERSION [pytest args...]" >&2
  exit 2
fi
VERSION=$1
shift
BASELINE="$PWD/tests/vllm_referee/baseline-$VERSION.txt"
if [ "${1:-}" = --record ]; then
  shift
  export REFEREE_CLASSES=vllm REFEREE_RECORD="$BASELINE"
elif [ -f "$BASELINE" ]; then
  export REFEREE_KNOWN="$BASELINE"
fi
.venv/bin/python -m tools.vllm_sources "$VERSION" >/dev/null
SRC="$PWD/.cache/vllm/$VERSION"
FILES=(tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py)

WORK=$(mktemp -d)
PORT=$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/chunkledger serve --db "duckdb:///$WORK/ledger.duckdb" --host 127.0.0.1 --port "$PORT" \
  >"$WORK/ledger.log" 2>&1 &
LEDGER=$!
trap 'kill $LEDGER 2>/dev/null; wait $LEDGER 2>/dev/null || true; rm -rf "$WORK"' EXIT
for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done

echo "vllm $VERSION: vLLM's scheduler tests with ${REFEREE_CLASSES:-ledger} classes" >&2
cd "$SRC"
CHUNKLEDGER_URL="http://127.0.0.1:$PORT" CHUNKLEDGER_SPOOL_DIR="$WORK/spool" \
  PYTHONPATH="$SRC:$OLDPWD:$OLDPWD/tests/vllm_referee${PYTHONPATH:+:$PYTHONPATH}" \
  "$OLDPWD/.venv/bin/python" -m pytest -q -p no:cacheprovider -p referee_plugin --rootdir "$SRC" \
  --noconftest -o addopts= -o python_files='test_*.py' "${FILES[@]}" "$@"
