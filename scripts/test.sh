#!/usr/bin/env bash
# Install everything into .venv and run the whole test suite: lint, types, and every pytest marker
# (slow and PostgreSQL-backed suites included). Needs PostgreSQL on 127.0.0.1:5432 (trust auth,
# database `test`); starts the local cluster if it is installed but stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,dashboard]'

# vLLM on CPU for the tests marked vllm (scripts/install_vllm.sh says how and why).
bash scripts/install_vllm.sh

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
