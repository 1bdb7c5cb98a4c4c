#!/usr/bin/env bash
# The one script for the H200 (one device call, < 10 minutes): carried wheels, the real-size random checkpoint, a
# smoke run that picks a working configuration, then, most valuable first and each only while time is left: the
# VoxCPM2 sweep (+ closed loop + Poisson), the per-module profile, the GPU tests, LoRA, VoxCPM1.5, the kernel bench.
# JSON and logs go to $OUT (at most 8 files come back); a short table is printed last.
#
#   bash bench/gpu_run.sh                  (device run with carry [".whl"]; VOXGATE_COMMIT=<hash> names the commit)
#   BUDGET=250 QUICK=1 bash bench/gpu_run.sh   (c=1,8,64,256 sweep, profile, GPU tests, LoRA at c=1,64)
#   PLAN=sweep,lora,gateway,tests TESTS="tests/gpu/test_vae_gpu.py" bash bench/gpu_run.sh   (chosen stages)
#   SWEEP_LEVELS=1,64,256 SWEEP_EXTRA=poisson:45 (sweep), CAP_ARGS="--sessions 500 --tick-ms 112" (gateway_capacity),
#   BENCH_ARGS="--vae-dtype bfloat16" (every engine_bench run but the profile),
#   CAPACITY_LEVELS=closed:400,closed:480 CAPACITY_VAE=float32,bfloat16 CAPACITY_RAMP=6 CAPACITY_DURATION=20 (capacity)
#   LORA_LOG=DEBUG (each step of the lora stage in lora.log), LORA_ARGS=--timeline (lora),
#   LORA_VARIANTS="two_pdl two_n128" (lora_variants: VOXGATE_LORA_LARGE_VARIANT per engine)
#   RACE_RUNS=3 (race: the async/VAE-lane race tests, each run in a fresh pytest)
#   MIXED_MAX=10,12 MIXED_OTHER_TIMESTEPS=5,1 (mixed_settings: one run per served maximum of timesteps)
#   TWO_KEY_LEVELS=twokey:256 (two_key: key A's 256 streams at once against key B's one new stream)
#   GATEWAY_E2E_LEVELS=64:whole,256:whole,256:whole:pcm_s16le,closed:400:mix GATEWAY_E2E_DURATION=30
#   GATEWAY_E2E_PYSPY=6 (gateway_e2e: py-spy samples the gateway 6 s a level, its host and one front at once: GIL
#   holder, every thread; carry its wheel), GATEWAY_E2E_VARIANTS="VOXGATE_FRONTS=1 VOXGATE_FRONTS=4" (one run each)
#   CPU_CHECK=1 PY=.venv/bin/python PLAN=gateway_e2e GATEWAY_E2E_LEVELS=4:whole,closed:4:mix (no GPU: the plumbing of
#   the named stages on the tiny random model, written on the CPU; no smoke run)
#   GATEWAY_E2E_ARGS="--cushion-ms 100" (gateway_e2e; ARGS come after bench/gateway_load.py's own, so they win)
#   SMOKE=0 (no smoke run: ~40 s more for the stages, e.g. a gateway A/B
#   PLAN=gateway_e2e GATEWAY_E2E_LEVELS=64:whole,256:whole,256:whole,256:whole,closed:400:mix GATEWAY_E2E_DURATION=15
#   GATEWAY_E2E_VARIANTS="default VOXGATE_ENCODE_PROCS=1", ~170 s a variant)
#   stages: mixed_settings bisect race pdl_gemm persistent fp8 profile_burst bursts_fp8 fp8_ab quick_sweep sweep capacity vae_ab bursts prefill_attention profile profile_lora tests lora lora_nomerge lora_ab lora_variants lora256 lora_step lora_kernels gateway gateway_e2e gateway_capacity v15 kernels two_key soak
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/voxgate-out}
mkdir -p "$OUT"
PY=${PY:-python3}
T0=$SECONDS
BUDGET=${BUDGET:-570}  # seconds for the whole script
step() { echo "=== [+$((SECONDS - T0)) s] $*" >&2; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# run a stage only when `need` seconds are left; its timeout is what is left, at most `max`
stage() {  # stage NEED MAX NAME CMD...
    local need=$1 max=$2 name=$3; shift 3
    local l; l=$(left)
    if [ "$l" -lt "$need" ]; then step "skip $name ($l s left)"; return 1; fi
    step "$name"
    timeout $((l < max ? l : max)) "$@"
}

if compgen -G ".whl/*.whl" >/dev/null; then
    step "install carried wheels"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "wheel install failed" >&2
fi
# libopus and opuslib (the device machine has neither): the .so into /usr/local/lib, the pure-Python sdist on the path
OPUS_PATH=
if compgen -G ".whl/libopus0_*.deb" >/dev/null && ! ldconfig -p | grep -q libopus.so.0; then
    step "install carried libopus"
    mkdir -p /tmp/debs && dpkg -x .whl/libopus0_*.deb /tmp/debs && cp -a /tmp/debs/usr/lib/*/libopus.so* /usr/local/lib/ \
        && ldconfig || echo "libopus install failed" >&2
fi
if compgen -G ".whl/opuslib-*.tar.gz" >/dev/null; then
    mkdir -p /tmp/opuslib && tar -xzf .whl/opuslib-*.tar.gz -C /tmp/opuslib && OPUS_PATH=$(ls -d /tmp/opuslib/opuslib-*):
fi
export PYTHONPATH=/tmp/site:$OPUS_PATH.
# the Opus frame encoder's C helper, built in place as `pip install -e .` would (the gateway stages measure it)
$PY setup.py -q build_ext --inplace >/dev/null 2>>"$OUT/smoke.log" || echo "gateway/_opus_frames.c did not build" >&2
export TRITON_INTERPRET=0 VOXGATE_LOG=${VOXGATE_LOG:-INFO} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU")
echo "$GPU"
COMMIT=${VOXGATE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null)} || true
COMMIT=${COMMIT:-unknown}

TMP=$($PY -c 'import tempfile; print(tempfile.gettempdir())')
V2=$TMP/voxgate-bench-voxcpm2-stop-never
V15=$TMP/voxgate-bench-voxcpm1.5-stop-never
SIZE=voxcpm2 DEVICE=cuda
[ "${CPU_CHECK:-0}" = 1 ] && V2=$TMP/voxgate-bench-tiny-stop-never SIZE=tiny DEVICE=cpu
step "write the random $SIZE checkpoint (stop head never fires) to $V2"
[ -f "$V2/config.json" ] || $PY -m engine.random_checkpoint "$V2" --size $SIZE --stop-never --device $DEVICE
export VOXGATE_VOXCPM2_DIR=$V2
BENCH="$PY bench/engine_bench.py --model $V2 --patches 60 --timesteps 10 --prompt-positions 114 ${BENCH_ARGS:-}"  # as the anchor

# Smoke: a few short requests. If the fused kernels or the graphs fail here, fall back so the numbers still come.
smoke() { timeout 90 $BENCH --concurrency 1,4 --patches 8 --requests 4 --max-num-seqs 16 2>>"$OUT/smoke.log" | tail -4; }
if [ "${CPU_CHECK:-0}" = 1 ]; then step "CPU check: no smoke run"
elif [ "${SMOKE:-1}" = 0 ]; then step "SMOKE=0: no smoke run (the defaults are known to work on this device)"
elif step "smoke run (fused kernels + CUDA graphs)"; ! smoke; then
    export VOXGATE_FUSED_KERNELS=0; step "smoke failed: again without the fused kernels"
    if ! smoke; then export VOXGATE_CUDA_GRAPHS=0; step "smoke failed: again without CUDA graphs"; smoke; fi
fi
echo "configuration: VOXGATE_FUSED_KERNELS=${VOXGATE_FUSED_KERNELS:-1} VOXGATE_CUDA_GRAPHS=${VOXGATE_CUDA_GRAPHS:-1}" \
    | tee -a "$OUT/smoke.log"

# PLAN: the stages, in order (each runs only while BUDGET leaves it time). QUICK=1 is the short plan.
DEFAULT_PLAN=sweep,profile,tests,lora,v15,kernels
[ "${QUICK:-0}" = 1 ] && DEFAULT_PLAN=quick_sweep,profile,tests,lora
TESTS=${TESTS:-$(ls tests/gpu/test_*.py tests/test_audio_vae.py tests/test_model_oracle.py 2>/dev/null)}
for STAGE in $(echo "${PLAN:-$DEFAULT_PLAN}" | tr ',' ' '); do
    case $STAGE in
    quick_sweep)  # SWEEP_LOG=DEBUG: the worker logs each step's wall-clock start, to line up with --timeline
        stage 60 150 "short VoxCPM2 sweep" env VOXGATE_LOG="${SWEEP_LOG:-$VOXGATE_LOG}" $BENCH \
            --concurrency 1,8,64,256 --requests-factor 1 --max-num-seqs 256 --timeline \
            --out "$OUT/engine_voxcpm2.json" 2>"$OUT/engine_voxcpm2.log" >/dev/null ;;
    sweep)
        stage 120 260 "VoxCPM2 sweep, closed loop, Poisson" $BENCH --concurrency "${SWEEP_LEVELS:-1,8,32,64,128,256,512}" \
            --requests-factor "${SWEEP_FACTOR:-2}" --max-requests 512 --max-num-seqs 512 \
            --extra "${SWEEP_EXTRA:-closed:64,poisson:16}" --duration "${SWEEP_DURATION:-15}" \
            --out "$OUT/engine_voxcpm2.json" 2>"$OUT/engine_voxcpm2.log" >/dev/null ;;
    capacity)  # issue 4's capacity figure: C closed-loop users started over CAPACITY_RAMP s (steady arrivals, not
        # synchronized bursts), steady state read after the ramp; c=1 and a 64 burst on the same engine; per VAE dtype
        for dt in $(echo "${CAPACITY_VAE:-float32,bfloat16}" | tr ',' ' '); do
            stage 90 200 "capacity, VAE $dt" $BENCH --vae-dtype "$dt" --concurrency 1,64 --requests-factor 2 \
                --extra "${CAPACITY_LEVELS:-closed:400,closed:480}" --ramp "${CAPACITY_RAMP:-6}" \
                --duration "${CAPACITY_DURATION:-20}" --max-num-seqs 512 \
                --out "$OUT/capacity_$dt.json" 2>"$OUT/capacity_$dt.log" >/dev/null
        done ;;
    mixed_settings)  # issue 27: 64 streams, one of them (then a quarter) at other timesteps and cfg, against the
        # uniform batch on the same engine (before and after); MIXED_MAX=10,12: once per served maximum (at 12 the
        # other streams ask for 12 and 5: the streams at 12 finish their 2 extra evaluations in the step's tail)
        for mx in $(echo "${MIXED_MAX:-10}" | tr ',' ' '); do
            others=${MIXED_OTHER_TIMESTEPS:-5,1}; [ "$mx" != 10 ] && others=${MIXED_OTHER_TIMESTEPS:-$mx,5}
            stage 120 240 "mixed settings, served timesteps up to $mx" $BENCH --concurrency 64 --requests-factor 2 \
                --max-num-seqs 256 --max-timesteps "$mx" --other-timesteps "$others" --other-cfg 1.0,3.0 \
                --extra mixed-one:64,mixed-quarter:64,batch:64 \
                --out "$OUT/mixed_settings_max$mx.json" 2>"$OUT/mixed_settings_max$mx.log" | tail -3 | tee -a "$OUT/smoke.log"
        done ;;
    profile)
        stage 40 120 "per-module profile" $PY bench/engine_bench.py --model $V2 --profile \
            --out "$OUT/profile.json" 2>>"$OUT/smoke.log" >/dev/null ;;
    bisect)  # s15c: with the large LM graphs the fused smoke failed at engine start ("an illegal memory access",
        # reported by a later cuBLAS call) while the unfused one ran. The smoke in seven settings, ~45 s each, the
        # worker's start traceback (VOXGATE_LOG=DEBUG) in bisect.log: as is; with CUDA_LAUNCH_BLOCKING=1 (the
        # faulting op, if it faults outside a capture); text-only large graphs (no LocEnc rows); none; unfused; no
        # cuBLAS workspace (a guess: the fused engine's large captured GEMMs, new in s15c, may be the first to pick
        # algorithms that use it under capture); cuBLASLt (its workspace passed per call) instead of cublasGemmEx.
        # s16a found it (a warm-up race, only CUDA_LAUNCH_BLOCKING=1 and no large graphs ran); kept for the next fault
        for v in DEFAULT CUDA_LAUNCH_BLOCKING=1 VOXGATE_LARGE_LM_GRAPHS=text VOXGATE_LARGE_LM_GRAPHS=0 \
            VOXGATE_FUSED_KERNELS=0 CUBLAS_WORKSPACE_CONFIG=:0:0 TORCH_BLAS_PREFER_CUBLASLT=1; do
            step "bisect: $v"
            echo "=== bisect: $v" >>"$OUT/bisect.log"
            env -u VOXGATE_FUSED_KERNELS -u VOXGATE_CUDA_GRAPHS ${v/DEFAULT/VOXGATE_LARGE_LM_GRAPHS=1} \
                VOXGATE_LOG=DEBUG timeout 120 $BENCH --concurrency 1,4 --patches 8 --requests 4 --max-num-seqs 16 \
                >>"$OUT/bisect.log" 2>&1 && echo "bisect: $v ok" | tee -a "$OUT/smoke.log" \
                || echo "bisect: $v FAILED" | tee -a "$OUT/smoke.log"
        done ;;
    profile_burst)  # the host's side of a c=64 burst's prefill step (cProfile, GPU idle gaps), bf16 then FP8 prefill
        for mode in bf16 fp8; do
            flags=; [ "$mode" = fp8 ] && flags=--fp8-prefill
            stage 40 120 "host profile of a burst's prefill step, $mode" $PY bench/engine_bench.py --model $V2 \
                --profile --profile-mixed $flags --out "$OUT/profile_burst_$mode.json" 2>>"$OUT/profile_burst.log" \
                | tail -6 | tee -a "$OUT/smoke.log"
        done ;;
    profile_lora)  # the same with 32 adapters in LoRA slots, rows spread over them: where LoRA's time goes (up to
        # ~120 s when it is the first stage to compile the LoRA kernels: s10b lost it at an 80 s cap)
        stage 40 150 "per-module profile with 32 LoRA adapters" $PY bench/engine_bench.py --model $V2 --profile \
            --lora 32 --out "$OUT/profile_lora32.json" 2>>"$OUT/smoke.log" >/dev/null ;;
    tests)
        # -v names each test as it ends (a stage cut at its cap leaves no summary: s11d lost a failure's name that
        # way); the whole GPU suite takes ~300 s on the H200
        # in the default configuration even when the smoke fell back (s15c: its VOXGATE_FUSED_KERNELS=0 made the
        # suite pass unfused while the fused engine could not start)
        stage 60 420 "GPU tests" env -u VOXGATE_FUSED_KERNELS -u VOXGATE_CUDA_GRAPHS $PY -m pytest -v -rfE \
            --tb=short -m gpu -p no:cacheprovider -s --timeout 120 $TESTS >"$OUT/gpu_tests.log" 2>&1
        grep -E "(PASSED|FAILED|ERROR)( |$)|^(FAILED|ERROR) |passed|failed" "$OUT/gpu_tests.log" | tail -25 ;;
    lora)
        stage 50 120 "LoRA: 32 adapters at c=1 and 64" env VOXGATE_LOG="${LORA_LOG:-$VOXGATE_LOG}" $BENCH \
            --concurrency 1,64 --requests-factor 2 --max-num-seqs 256 --lora 32 ${LORA_ARGS:-} \
            --out "$OUT/engine_voxcpm2_lora32.json" 2>"$OUT/lora.log" >/dev/null ;;
    lora_nomerge)  # the A/B of `lora`: always the LoRA kernels, no adapter merged into the weights at c=1
        stage 50 120 "LoRA: 32 adapters at c=1 and 64, kernels only" $BENCH --concurrency 1,64 --requests-factor 2 \
            --max-num-seqs 256 --lora 32 --no-merge-lora --out "$OUT/engine_voxcpm2_lora32_nomerge.json" \
            2>"$OUT/lora_nomerge.log" >/dev/null ;;
    lora_ab)  # issue 9's figures side by side: no LoRA, 32 and 256 adapters, c=1 and 64 twice each (one engine each)
        for n in ${LORA_AB:-0 32 256}; do
            stage 70 160 "A/B: $n LoRA adapters, c=1,64,1,64" $BENCH --concurrency 1,64,1,64 --requests-factor 2 \
                --max-num-seqs 256 $([ "$n" -gt 0 ] && echo "--lora $n") --out "$OUT/lora_ab_$n.json" \
                2>"$OUT/lora_ab_$n.log" >/dev/null
        done ;;
    lora_variants)  # the large LoRA variant end to end: 32 adapters, c=1,64,1,64, one engine per variant
        for v in ${LORA_VARIANTS:-two_pdl two_n128}; do
            stage 70 160 "A/B: LoRA variant $v, 32 adapters, c=1,64,1,64" env VOXGATE_LORA_LARGE_VARIANT=$v $BENCH \
                --concurrency 1,64,1,64 --requests-factor 2 --max-num-seqs 256 --lora 32 \
                --out "$OUT/lora_variant_$v.json" 2>"$OUT/lora_variant_$v.log" >/dev/null
        done ;;
    vae_ab)  # the VAE lane against the VAE inside each step's graph: c=1,64,1,64 and a steady closed loop, each
        for v in 1 0; do
            stage 70 170 "A/B: VAE lane $v" env VOXGATE_VAE_STREAM=$v $BENCH --concurrency 1,64,1,64 \
                --requests-factor 2 --max-num-seqs 512 --extra "${VAE_AB_EXTRA:-closed:128}" --ramp 3 --duration 10 \
                --out "$OUT/vae_ab_$v.json" 2>"$OUT/vae_ab_$v.log" >/dev/null
        done ;;
    bursts)  # three bursts each at c=1, 8 and 64, every step and publish logged and every request's start and TTFB
        # kept (bench/burst_timeline.py splits each c=64 burst's TTFB into its host and device parts)
        stage 60 150 "bursts with timelines" env VOXGATE_LOG=DEBUG $BENCH --concurrency 1,8,64,1,8,64,1,8,64 \
            --requests-factor 1 --max-num-seqs 512 --timeline --out "$OUT/bursts.json" 2>"$OUT/bursts.log" >/dev/null ;;
    fp8)  # the LMs' prefill GEMMs at a c=64 burst's rows, bf16 against FP8 (bench/fp8_bench.py, ~15 s)
        stage 30 90 "FP8 prefill GEMMs" $PY bench/fp8_bench.py --out "$OUT/fp8.json" 2>&1 | tail -24 | tee -a "$OUT/smoke.log" ;;
    bursts_fp8)  # the bursts stage with the LMs' large GEMMs in FP8 (--fp8-prefill)
        stage 60 150 "bursts with timelines, FP8 prefill" env VOXGATE_LOG=DEBUG $BENCH --fp8-prefill \
            --concurrency 1,8,64,1,8,64,1,8,64 --requests-factor 1 --max-num-seqs 512 --timeline \
            --out "$OUT/bursts_fp8.json" 2>"$OUT/bursts_fp8.log" >/dev/null ;;
    persistent)  # the LocDiT's batch-1 GEMM chain as one persistent launch with grid barriers, against cuBLAS (~20 s;
        # a barrier that never opens is cut by the stage's timeout)
        stage 30 60 "persistent GEMM chain" $PY bench/persistent_gemm_bench.py --out "$OUT/persistent.json" 2>&1 \
            | tail -24 | tee -a "$OUT/smoke.log" ;;
    fp8_ab)  # c=1, a 64 burst and 256 at once, bf16 then with every FP8 switch (--fp8-prefill --fp8-dit), ~2 x 60 s
        for mode in bf16 fp8; do
            flags=; [ "$mode" = fp8 ] && flags="--fp8-prefill --fp8-dit"
            stage 60 120 "A/B $mode" $BENCH $flags --concurrency 1,64,256,64 --requests-factor 1 --max-num-seqs 512 \
                --out "$OUT/ab_$mode.json" 2>"$OUT/ab_$mode.log" >/dev/null
        done ;;
    prefill_attention)  # the LMs' paged attention over a burst's prefill at a few query tiles (bench/kernels_bench.py)
        stage 20 90 "prefill attention tiles" $PY bench/kernels_bench.py --only-prefill \
            --out "$OUT/prefill_attention.json" 2>&1 | tail -8 | tee -a "$OUT/smoke.log" ;;
    lora256)  # issue 9's second figure: 256 registered adapters, requests spread across all of them
        stage 70 150 "LoRA: 256 adapters at c=1 and 64" $BENCH --concurrency 1,64 --requests-factor 2 \
            --max-num-seqs 256 --lora 256 --out "$OUT/engine_voxcpm2_lora256.json" 2>"$OUT/lora256.log" >/dev/null ;;
    lora_step)  # every LoRA kernel variant inside a graph of a whole step's layers (cold weights), vs no LoRA
        stage 40 150 "LoRA step-like bench" $PY bench/lora_bench.py --step --out "$OUT/lora_step.json" \
            >"$OUT/lora_step.log" 2>&1
        tail -25 "$OUT/lora_step.log" ;;
    lora_kernels)
        stage 30 120 "LoRA kernels" $PY bench/lora_bench.py --out "$OUT/lora_kernels.json" 2>&1 | tail -20 \
            >>"$OUT/smoke.log" ;;
    gateway)  # the gateway in its own process over the real engine: client TTFB - engine TTFB, CPU per stream
        stage 60 120 "gateway, 64 sessions" $PY bench/gateway_load.py --model $V2 ${GATEWAY_ARGS:---spawn-server \
            --sessions 64 --mode whole --format pcm_s16le --client-procs 4 --max-length 20} \
            --json "$OUT/gateway_load_64.json" >"$OUT/gateway.log" 2>&1
        tail -12 "$OUT/gateway.log" ;;
    gateway_e2e)  # issue 34: Opus sessions through the gateway (its own process, as `voxgate serve`) over the real
        # engine, 8 client processes, ~60-word paragraphs at 12 patches a segment (~6 segments, ~11.5 s of audio a
        # turn): 64 and 256 at once (text whole; 256 again in PCM: what the Opus pool adds), then 400 in closed loop
        # (half whole, half LLM deltas) for 6 s of ramp and GATEWAY_E2E_DURATION s; ~3 min with the engine's start
        # GATEWAY_E2E_VARIANTS="VOXGATE_FRONTS=1 VOXGATE_FRONTS=4": one run per environment setting (the gateway's
        # own: its processes inherit it), each into gateway_e2e_<setting>.json; without it one run into
        # gateway_e2e.json. The JSON's gateway figures are per process (host, each front: CPU, loop lag, GC, RSS)
        levels=${GATEWAY_E2E_LEVELS:-64:whole,256:whole,256:whole:pcm_s16le,closed:400:mix}
        for variant in ${GATEWAY_E2E_VARIANTS:-default}; do
            name=gateway_e2e; [ "$variant" != default ] && name=gateway_e2e_$(echo "$variant" | tr -c 'A-Za-z0-9\n' '_')
            stage 150 270 "gateway end to end ($variant): $levels" env ${variant/default/} $PY bench/gateway_load.py \
                --model $V2 --spawn-server --max-num-seqs 512 --client-procs 8 --format opus --max-length 12 \
                --turns 1 --ramp 6 --duration "${GATEWAY_E2E_DURATION:-30}" --sessions "$levels" \
                --py-spy "${GATEWAY_E2E_PYSPY:-0}" --py-spy-dir "/tmp/pyspy/$name" ${GATEWAY_E2E_ARGS:-} \
                --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
            tail -5 "$OUT/$name.log"
        done
        [ -d /tmp/pyspy ] && tar -czf "$OUT/pyspy.tar.gz" -C /tmp pyspy ;;
    gateway_capacity)  # Opus sessions over the stand-in engine (no GPU): the gateway's own CPU per stream
        stage 60 120 "gateway capacity, Opus sessions over the stand-in" $PY bench/gateway_capacity.py \
            ${CAP_ARGS:---sessions 250,500} --client-procs 6 --duration 15 --json "$OUT/gateway_capacity.json" \
            >"$OUT/gateway_capacity.log" 2>&1
        tail -12 "$OUT/gateway_capacity.log" ;;
    two_key)  # issue 27: B's first audio behind A's burst (tenants, and one shared tenant) against B's while A's
        # streams speak (bench/two_key.py); room for A's 256 and B's one, so B never waits for a free slot
        stage 60 180 "two keys: a 256 burst against one new stream" $BENCH --concurrency 1 --patches 40 \
            --extra "${TWO_KEY_LEVELS:-twokey:256}" --max-num-seqs 320 \
            --out "$OUT/two_key.json" 2>"$OUT/two_key.log" >/dev/null ;;
    soak)  # issue 27: the worker's RSS under cancel storms, the CPU suite's soak test on a CUDA worker (tiny model)
        stage 60 150 "worker memory soak on CUDA" $PY -m pytest -v -rfE --tb=short -p no:cacheprovider -s \
            tests/test_worker_memory.py >"$OUT/soak.log" 2>&1
        grep -E "RSS|passed|failed" "$OUT/soak.log" | tail -5 ;;
    v15)
        if [ "$(left)" -gt 80 ]; then
            [ -f "$V15/config.json" ] || $PY -m engine.random_checkpoint "$V15" --size voxcpm1.5 --stop-never \
                --device cuda
            stage 40 90 "VoxCPM1.5 at c=1 and 64" $PY bench/engine_bench.py --model "$V15" --patches 60 \
                --timesteps 10 --concurrency 1,64 --requests-factor 1 --max-num-seqs 256 \
                --out "$OUT/engine_voxcpm15.json" 2>"$OUT/engine_voxcpm15.log" >/dev/null
        fi ;;
    race)  # the two tests that caught the VAE lane sharing the step graphs' cuBLAS workspace (s13), RACE_RUNS times
        # each in a fresh pytest (~30-40 s a run; they failed 5 runs of 5 and 2 of 3 before the fix)
        for i in $(seq "${RACE_RUNS:-3}"); do
            stage 50 120 "race check $i" $PY -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider -s --timeout 100 \
                "tests/gpu/test_lora_gpu.py::test_merged_adapter_equals_the_lora_kernels_in_the_engine[async]" \
                tests/gpu/test_engine_gpu.py::test_vae_lane_equals_the_vae_inside_the_step_graph \
                tests/gpu/test_cuda_graphs_gpu.py >"$OUT/race_$i.log" 2>&1
            grep -E "bit-identical|vs merged|passed|failed" "$OUT/race_$i.log" | cut -c1-160
        done ;;
    pdl_gemm)  # batch-1 GEMM chains, shape by shape, cold and hot: cuBLAS against a Triton skinny GEMM, plain, split
        # over K, launched as a programmatic dependent (PDL) early or late, with its weights asked into L2 (~60 s)
        stage 60 150 "PDL GEMM chains" $PY bench/pdl_gemm_bench.py --out "$OUT/pdl_gemm.json" >"$OUT/pdl_gemm.log" 2>&1
        tail -12 "$OUT/pdl_gemm.log" ;;
    kernels)
        [ -f bench/kernels_bench.py ] && stage 40 60 "kernel benchmark" $PY bench/kernels_bench.py 2>&1 \
            | tail -30 >>"$OUT/smoke.log" ;;
    *) echo "unknown stage $STAGE" >&2 ;;
    esac
done
grep -h "GPU memory" "$OUT"/*.log | tail -2 >&2

step "done; tables"
[ -n "${VOXGATE_FUSED_KERNELS:-}${VOXGATE_CUDA_GRAPHS:-}" ] && echo "WARNING: the smoke run failed; every engine run" \
    "above ran with VOXGATE_FUSED_KERNELS=${VOXGATE_FUSED_KERNELS:-1} VOXGATE_CUDA_GRAPHS=${VOXGATE_CUDA_GRAPHS:-1}" \
    "(see smoke.log): these numbers are not the default engine's"
$PY - "$OUT" "$COMMIT" "$GPU" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from engine_bench import profile_table, table
out, commit, gpu = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
print(f"commit {commit}; GPU {gpu}")
for name in ("profile.json", "profile_lora32.json", "engine_voxcpm2.json", "engine_voxcpm2_lora32.json", "engine_voxcpm2_lora256.json",
             "engine_voxcpm15.json", "capacity_float32.json", "capacity_bfloat16.json",
             "engine_voxcpm2_lora32_nomerge.json", "lora_ab_0.json", "lora_ab_32.json", "lora_ab_256.json",
             "bursts.json", "bursts_fp8.json", "ab_bf16.json", "ab_fp8.json", "two_key.json", *sorted(p.name for p in out.glob("lora_variant_*.json"))):
    path = out / name
    if not path.exists():  # a stage not in the plan, or one that failed (its log is in logs.tar.gz)
        continue
    result = json.loads(path.read_text())
    if len(result.get("git_commit") or "") != 40:
        result["git_commit"] = commit
    path.write_text(json.dumps(result, indent=2))
    print(f"\n{name} ({result.get('date', '')}, {result.get('command', 'profile')})")
    print(profile_table(result) if name.startswith("profile") else table(result))
PYEOF
# at most 8 files come back from a device run: the logs travel as one archive
( cd "$OUT" && compgen -G "*.log" >/dev/null && tar -czf logs.tar.gz ./*.log && rm -f ./*.log )
