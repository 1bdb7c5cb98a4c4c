#!/usr/bin/env bash
# Several GPUs on nvidia-h200-x2 (< 8 minutes): the real-size random VoxCPM2 checkpoint; TP=2 vs TP=1 output
# (bf16 tolerance); engine_bench capacity with one worker (devices 0) vs two data-parallel workers (devices 0,1);
# TP=2 latency at concurrency 1 and its capacity. JSON and logs go to $OUT; a table is printed last.
#
#   bash bench/multigpu_run.sh            (device run, kind nvidia-h200-x2)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/voxgate-out}
mkdir -p "$OUT"
PY=${PY:-python3}
T0=$SECONDS
step() { echo "=== [+$((SECONDS - T0)) s] $*" >&2; }

# NVLink multicast stays off in every process started from here (it can take a shared host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "wheel install failed" >&2
fi
export PYTHONPATH=/tmp/site:.
export VOXGATE_LOG=${VOXGATE_LOG:-WARNING}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
LEVELS=${LEVELS:-256,512}

V2=$($PY -c 'import tempfile; print(tempfile.gettempdir())')/voxgate-bench-voxcpm2-stop-never
step "write the real-size random VoxCPM2 checkpoint (stop head never fires) to $V2"
[ -f "$V2/config.json" ] || timeout 120 $PY -m engine.random_checkpoint "$V2" --size voxcpm2 --stop-never --device cuda

step "TP=2 vs TP=1 output"
timeout 200 $PY bench/tp_equality.py "$V2" "$OUT/tp_equality.json" 2>"$OUT/tp_equality.log" | tail -3

# engine_bench builds its own Engine: place it on the given devices with the given tensor-parallel size
bench() {
    local name=$1 devices=$2 tp=$3 levels=$4
    case " ${SKIP:-} " in *" $name "*) step "skip $name (SKIP)"; return 0;; esac
    step "engine_bench $name: devices $devices, tensor_parallel_size $tp, concurrency $levels"
    timeout "${BENCH_TIMEOUT:-150}" $PY - "$devices" "$tp" --model "$V2" --patches 60 --timesteps 10 \
        --concurrency "$levels" --requests-factor 1 --max-num-seqs 512 --out "$OUT/engine_$name.json" \
        <<'EOF' 2>"$OUT/engine_$name.log" | tail -6
import runpy, sys
import engine

devices, tp = [int(d) for d in sys.argv[1].split(",")], int(sys.argv[2])

class Placed(engine.Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, devices=devices, tensor_parallel_size=tp, **kwargs)

engine.Engine = Placed
sys.argv = ["bench/engine_bench.py", *sys.argv[3:]]
runpy.run_path("bench/engine_bench.py", run_name="__main__")
EOF
}
bench dp1 0 1 "1,$LEVELS"
bench dp2 0,1 1 "$LEVELS"
bench tp2 0,1 2 "1,$LEVELS"

step "summary"
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def levels(name):
    p = out / f"engine_{name}.json"
    return {lv["concurrency"]: lv for lv in json.loads(p.read_text())["levels"]} if p.exists() else {}
runs = {name: levels(name) for name in ("dp1", "dp2", "tp2")}
eq = json.loads((out / "tp_equality.json").read_text()) if (out / "tp_equality.json").exists() else {}
summary = {"tp_equality": {k: v for k, v in eq.items() if k != "patch_rel_err"}, "capacity_ratio_dp2_dp1": {}}
print("| setup | concurrency | TTFB p50 / p99 (ms) | RTF mean | steps/s | audio s/s |")
print("|---|---|---|---|---|---|")
for name, lv in runs.items():
    for c, r in sorted(lv.items()):
        t = r["ttfb_ms"]
        print(f"| {name} | {c} | {t['p50']:.0f} / {t['p99']:.0f} | {r['rtf_mean']:.3f} | {r['steps_per_s']:.1f} "
              f"| {r['audio_s_per_s']:.1f} |")
for c in sorted(set(runs["dp1"]) & set(runs["dp2"])):
    summary["capacity_ratio_dp2_dp1"][str(c)] = runs["dp2"][c]["audio_s_per_s"] / runs["dp1"][c]["audio_s_per_s"]
dp1 = runs["dp1"]
for c2, r in runs["dp2"].items():  # equal load per GPU: dp2 at 2C against dp1 at C
    if c2 // 2 in dp1:
        summary["capacity_ratio_dp2_dp1"][f"{c2} vs {c2 // 2}"] = r["audio_s_per_s"] / dp1[c2 // 2]["audio_s_per_s"]
(out / "multigpu_summary.json").write_text(json.dumps(summary, indent=2))
print()
print(f"TP=2 vs TP=1: {summary['tp_equality']}")
for k, v in summary["capacity_ratio_dp2_dp1"].items():
    print(f"capacity dp2 / dp1 at concurrency {k}: {v:.2f}x (target >= 1.9)")
EOF
step "done"
