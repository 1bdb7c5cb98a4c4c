#!/usr/bin/env bash
# The one script for the H200 (< 9 minutes): carried wheels, real-size random checkpoints, the GPU tests, the kernel
# and engine benchmarks (VoxCPM2 sweep + closed loop + Poisson, VoxCPM1.5 at c=1 and 64), the per-module profile.
# JSON and logs go to $OUT; a short table is printed last. QUICK=1: tests + a short sweep (c=1,64,256) only.
#
#   bash bench/gpu_run.sh            (device run with carry [".whl"])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/voxgate-out}
mkdir -p "$OUT"
PY=${PY:-python3}
T0=$SECONDS
step() { echo "=== [+$((SECONDS - T0)) s] $*" >&2; }

step "install carried wheels"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "wheel install failed" >&2
fi
export PYTHONPATH=/tmp/site:.
export VOXGATE_LOG=${VOXGATE_LOG:-INFO} NCCL_NVLS_ENABLE=0
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)
echo "$GPU"  # $OUT keeps at most 8 files: the logs and JSONs below
# The device copy may have no git history: the caller can pass the commit as VOXGATE_COMMIT.
COMMIT=${VOXGATE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null)} || true
COMMIT=${COMMIT:-unknown}

TMP=$($PY -c 'import tempfile; print(tempfile.gettempdir())')
V2=$TMP/voxgate-bench-voxcpm2-stop-never
V15=$TMP/voxgate-bench-voxcpm1.5-stop-never
step "write the real-size random VoxCPM2 checkpoint (stop head never fires) to $V2"
[ -f "$V2/config.json" ] || $PY -m engine.random_checkpoint "$V2" --size voxcpm2 --stop-never --device cuda
export VOXGATE_VOXCPM2_DIR=$V2

step "GPU tests"
TESTS=$(ls tests/gpu/test_*.py tests/test_audio_vae.py tests/test_model_oracle.py tests/test_kernels_gpu.py 2>/dev/null)
[ "${QUICK:-0}" = 1 ] && TESTS=tests/gpu/test_engine_gpu.py
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -m gpu -p no:cacheprovider -s $TESTS 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"

BENCH="$PY bench/engine_bench.py --model $V2 --patches 60 --timesteps 10"
if [ "${QUICK:-0}" = 1 ]; then
    step "short VoxCPM2 sweep"
    timeout 150 $BENCH --concurrency 1,64,256 --requests-factor 1 --max-num-seqs 256 --out "$OUT/engine_voxcpm2.json" \
        2>"$OUT/engine_voxcpm2.log" | tail -8
    step "per-module profile"
    timeout 60 $PY bench/engine_bench.py --model $V2 --profile --out "$OUT/profile.json" 2>>"$OUT/profile.log" | tail -6
else
    if [ -f bench/kernels_bench.py ]; then
        step "kernel benchmark"
        timeout 60 $PY bench/kernels_bench.py 2>&1 | tail -30 | tee "$OUT/kernels_bench.log"
    fi
    step "per-module profile"
    timeout 90 $PY bench/engine_bench.py --model $V2 --profile --out "$OUT/profile.json" 2>"$OUT/profile.log"
    step "VoxCPM2 sweep, closed loop, Poisson"
    timeout 240 $BENCH --concurrency 1,8,32,64,128,256,512 --requests-factor 2 --max-requests 512 --max-num-seqs 512 \
        --extra closed:64,poisson:16 --duration 15 --requests 0 --out "$OUT/engine_voxcpm2.json" \
        2>"$OUT/engine_voxcpm2.log" >/dev/null
    step "VoxCPM1.5 at c=1 and 64"
    [ -f "$V15/config.json" ] || $PY -m engine.random_checkpoint "$V15" --size voxcpm1.5 --stop-never --device cuda
    timeout 90 $PY bench/engine_bench.py --model "$V15" --patches 60 --timesteps 10 --concurrency 1,64 \
        --requests-factor 2 --max-num-seqs 256 --out "$OUT/engine_voxcpm15.json" 2>"$OUT/engine_voxcpm15.log" >/dev/null
fi
grep -h "GPU memory" "$OUT"/*.log | tail -2 >&2

step "done; tables"
$PY - "$OUT" "$COMMIT" "$GPU" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from engine_bench import profile_table, table
out, commit, gpu = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
print(f"commit {commit}; GPU {gpu}")
for name in ("profile.json", "engine_voxcpm2.json", "engine_voxcpm15.json"):
    path = out / name
    if not path.exists():
        print(f"{name}: missing (see the logs in {out})")
        continue
    result = json.loads(path.read_text())
    if len(result.get("git_commit") or "") != 40:
        result["git_commit"] = commit
    path.write_text(json.dumps(result, indent=2))
    print(f"\n{name} ({result.get('date', '')}, {result.get('command', 'profile')})")
    print(profile_table(result) if name == "profile.json" else table(result))
PYEOF
