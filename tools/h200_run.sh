#!/usr/bin/env bash
# What the H200 runs (through the device tool), one or more phases named by what they measure;
# results land in $OUT under the names bench/results/ keeps them by (bench/results/README.md).
#
#   bash tools/h200_run.sh PHASE [PHASE ...]
#
#   tests          every GPU test (tests/gpu, and the GPU cases of the process tests)
#   logprobs       the CUDA engine's log-probs across executor kills (tests/gpu/test_gpu_logprobs.py)
#   vmm            the sidecar keeps CUDA VMM memory with no CUDA context         -> vmm_probe_cuda.json
#   first-kernels  first launch of each Triton kernel in a zygote-forked child     -> first_kernels_cuda.json
#   prefill-attention  a prefill chunk's attention, first call per key length     -> prefill_attention_cuda.json
#   gemm           the decode GEMM kernel against cuBLAS, tile sweep               -> gemm_cuda.json
#   wide-tiles     a decode step's GEMMs at 128 and 256 rows: the 64-row decode tile over row blocks and the
#                  prefill tiles (the one exact_linear takes marked), a grid of tiles (bench_gemm's WIDE_GRID),
#                  each with its TFLOP/s and whether it gives the 64-row decode tile's bits -> gemm_wide_cuda.json
#   gemm-fp8       the FP8 kernel against cuBLAS on the dequantized weights, tile sweep (FP8_SCALES: rows
#                  or block)                                                      -> gemm_fp8_cuda.json
#   decode         Llama-3-8B decode step, commit on/off, batch 1/8/64 (ROUNDS)     -> decode_cuda.json
#   decode-256     Llama-3-8B decode step at batch 64/128/256 with --max-batch 256 (buckets 16..256, past 64
#                  rows on exact_linear's tiles), commit on/off (ROUNDS)             -> decode_cuda_256.json
#   decode-256-wide  decode-256 with KVHOLD_WIDE_DECODE_TILES=0 (past 64 rows on the prefill tiles), unset (the
#                  64-row decode tile over row blocks to 128 rows, the default) and 1 (to 256), after
#                  test_gpu_gemm.py's bits          -> decode_cuda_256_wide0.json, _widedefault.json, _wide1.json
#   decode-fp8     the same decode step on Llama-3-8B's shapes in FP8 (fp8-dynamic: per-channel weight scales),
#                  batch 1/8/64, the FP8 weights dequantized in registers (kvhold.executor.cuda.fp8_gemm)
#                                                                                  -> decode_fp8_cuda.json
#   fp8-70b        Llama-3-70B's shapes in FP8 (make_model --preset llama3-70b-fp8, about 73 GB: written to
#                  /dev/shm, the shards that do not fit spilled to /tmp; needs an H200): the decode step at
#                  batch 8/64 with --max-batch 64, prefill MFU against the FP8 dense peak (1,979 TFLOP/s),
#                  hot standby (FP8_KILLS, default 10) and zygote (FP8_ZYGOTE_KILLS, 3) recovery at 64 streams,
#                  and the cold restart without kvhold. A whole run outlasts one device call: FP8_STEPS
#                  (default "decode prefill recovery cold"; "build" alone builds) splits it over back-to-back
#                  calls on one warm machine, which keep the checkpoint; "tests" runs the whole GPU suite while
#                  the checkpoint is written (FP8_STEPS=tests: build and suite in one call, -> pytest_gpu.txt)
#                  -> decode_fp8_70b_cuda.json, prefill_fp8_70b_cuda.json, recovery_fp8_70b_cuda.json,
#                     cold_restart_fp8_70b_cuda.json. On an 80 GB card (an H100) the checkpoint leaves ~8 GiB, so
#                  decode, recovery and the cold restart run at reduced sizes (64-token prompts in a 720-page
#                  pool; 96-192-token prompts in a 4.5 GiB pool, or 880 pages for the cold restart) and every file
#                  is named *_fp8_70b_h100_cuda.json instead
#   profile        Llama-3-8B decode step, kernel by kernel                        -> decode_profile_cuda.json
#   recovery       Llama-3-8B, 64 streams: kill -> first resumed token, TIERS
#                  (default standby,zygote), KILLS (20) / ZYGOTE_KILLS (3) / COLD_KILLS / WAIT_KILLS
#                                                                                  -> recovery_cuda.json
#   takeover-profile  recovery as above (standby, PROFILE_KILLS, default 3) with KVHOLD_PROFILE_TAKEOVER:
#                  the promoted executor's kernels in its takeover and first steps
#                                                   -> takeover_profile_cuda.txt, recovery_cuda_profiled.json
#   prefix-cache   the prefix cache against none, Llama-3-8B, 64 streams: a 2,048-token shared system prompt,
#                  64-256-token first turns, 64-token follow-ups on the first answers, 64 tokens a turn,
#                  then SIGKILLs (PREFIX_KILLS, default 5) of the active executor in the follow-ups
#                  (tools/bench_prefix_cache.py)
#                                                                                  -> prefix_cache_cuda.json
#   checksum       the validation pass's checksum kernel at Llama-3-8B page shapes against its bandwidth
#                  floor and candidate kernels (tools/probe_checksum.py)          -> checksum_cuda.json
#   takeover       a takeover's parts in one process, Llama-3-8B, 64 streams (512-2048-token prompts) in a
#                  12,288-page pool: host bookkeeping and the KV work (checksums, tail copies) apart,
#                  TAKEOVER_TRIALS (9) takeovers from one saved state (tools/bench_takeover.py) -> takeover_host_cuda.json
#   mirror         foreign-pool mode: the KV mirror's decode cost, then recovery through the mirror
#                  (MIRROR_KILLS, default 5)                        -> mirror_cuda.json, recovery_cuda_foreign.json
#   vllm-mirror    the vLLM bridge's KV mirror at Llama-3-8B KV shapes in each of vLLM's six KV cache
#                  layouts, decode batches 8/64/256 and a 2,048-token prefill, against a decode step
#                  (tools/bench_vllm_mirror.py; no vLLM build)              -> vllm_bridge_mirror_cuda.json
#   pool-restart   pool restarts on the tiny model (no driver upgrade in between)  -> pool_restart_cuda.json
#   cold-restart   a restart without kvhold: import, load, allocate, capture, re-prefill -> cold_restart_cuda.json
#   prefill        Llama-3-8B prefill tokens/s and MFU, prompts 512/2048/8192, 1 and 8 at once, chunked as
#                  served (--max-batch-tokens 8192, LOAD's; exact prefill, the default); PREFILL_VARIANTS
#                  (default "served: fast:exact_prefill=0 chunk2048fast:prefill_chunk=2048,exact_prefill=0"),
#                  each LABEL:KEY=VALUE,...
#                  (tools/bench_prefill.py)
#                                                                                  -> prefill_cuda.json
#   serve          kvhold serve with Llama-3-8B, streaming HTTP at SERVE_CONCURRENCY (1,8,32,64), SERVE_ROUNDS (2)
#                  requests per stream: TTFT, ITL, tokens/s; then a SIGKILL of the active executor at
#                  SERVE_KILL_C (32) streams; SERVE_ARGS: the serve flags (default: LOAD's batch and KV)
#                                                                   -> serve_cuda.json (.png, .serve.log.gz)
#   serve-sharegpt kvhold serve with Llama-3-8B at production concurrency: ShareGPT-like lengths (prompts uniform
#                  in 128-512 ids, outputs uniform in 128-384 tokens, ignore_eos) at SERVE_CONCURRENCY
#                  (1,8,32,64,128,256), SERVE_ROUNDS (2), a SIGKILL of the active executor at SERVE_KILL_C (256)
#                  streams, each level beside its floor (bf16 peak prefill + bandwidth-floor decode);
#                  SERVE_ARGS (default --max-batch 256 --max-batch-tokens 832 --kv-memory 40GiB)
#                                                          -> serve_cuda_sharegpt.json (.png, .serve.log.gz)
#   serve-budgets  the serve load (2 rounds, a kill at 64 streams) at each step token budget (--max-batch-tokens)
#                  in SERVE_BUDGETS (default "8192 2112 1088 832 576")     -> serve_cuda_budget_B.json
#   exact          exact prefill: GPU tests (tests/gpu/test_gpu_exact.py), prefill tokens/s + MFU exact
#                  on/off (Llama-3-8B's shapes, 8 layers)           -> exact_tests.txt, exact_prefill_cuda.json
#   exact-gemm     the GEMM kernel's bits across tiles and its TFLOP/s against cuBLAS -> exact_gemm_cuda.json
#   prefill-tiles  the exact-prefill GEMM's candidate tiles at 512-8192 rows: TFLOP/s, bits, cuBLAS
#                  (tools/probe_prefill_tiles.py)                                  -> prefill_tiles_cuda.json
#   exact-e2e      exact recompute end to end, tiny model in bf16 (--exact-prefill; EXACT_CONTROL=1 also
#                  runs each without it): preemption in a small KV pool, 5 pool restarts,
#                  3 CUDA faults that damage 4 pages each    -> exact_preemption_cuda.json,
#                                                   exact_pool_restart_cuda.json, exact_cuda_fault_cuda.json
#   exact-fault    exact-e2e's last part alone: CUDA faults that damage 4 pages each (FAULT_TRIALS, default 3)
#                                                                                  -> exact_cuda_fault_cuda.json
#   cuda-fault     a real illegal-address fault in the active executor (tiny model, FAULT_TRIALS, default 5)
#                                                                                  -> cuda_fault_cuda.json
#   sidecar-crash  SIGKILL of the sidecar on VMM memory mid-stream: its executors hand the
#                  descriptors back (tests/gpu/test_gpu_sidecar_crash.py, tiny model), then the
#                  benchmark on LOAD (Llama-3-8B, 64 streams, 512-2048-token prompts, hot standby;
#                  SIDECAR_MAX_TOKENS, default 128, tokens each), SIDECAR_KILLS (default 5; 0 skips
#                  it) kills; SIDECAR_BENCH_S (330) of the budget is kept for it  -> sidecar_crash_cuda.json
#   recovery-tp    a tensor-parallel group (TP, default 2; needs that many GPUs): SIGKILL of a random rank
#                  (TP_KILLS, default 10), kill -> first resumed token, 64 streams (tools/bench_recovery_tp.py)
#                                                                             -> recovery_cuda_tp${TP}.json
#                  The benchmark refuses CUDA, saying why, until kvhold builds NCCL groups (docs/ARCHITECTURE.md
#                  section 10); it was written for Llama-3-70B shapes (random bf16) at TP=2.
#
# BUDGET_S (default 585) bounds the whole call: the last phase gets what is left of it.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVHOLD_CACHE=/tmp/kvcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-585}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

left() { echo $((BUDGET_S - SECONDS)); }
model_8b() { [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1; }
LOAD="--device cuda:0 --model /tmp/l8b --requests 64 --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304
      --max-batch-tokens 8192 --kv-memory 24GiB"

gpu_suite() {    # the whole GPU suite (the tests phase; fp8-70b's tests step, beside its build)
  python3 -c "import llguidance" 2>/dev/null || echo "tests: no llguidance here (tools/device_wheels.sh adds its wheel to .whl): the GPU constrained-output kill test will skip"
  # -v: a run cut short by the call's limit still names, in the log, each test it ran and how that ended
  timeout $(( $(left) < 540 ? $(left) : 540 )) python3 -m pytest -v -n 0 -p no:cacheprovider --continue-on-collection-errors tests -m gpu \
      -rfEs --durations=30 2>&1 | tee "$OUT/pytest_gpu.log" | grep -v " PASSED " | tail -60 | tee "$OUT/pytest_gpu.txt"
}

for phase in "${@:-tests}"; do
  echo "=== $phase ($(left) s left)"
  case "$phase" in
  tests)
    gpu_suite
    ;;
  logprobs)
    timeout $(( $(left) < 400 ? $(left) : 400 )) python3 -m pytest -q -n 0 -p no:cacheprovider \
        tests/gpu/test_gpu_logprobs.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu_logprobs.txt"
    ;;
  vmm)
    python3 -m tools.gpu_probe_vmm --size-mb 4096 > "$OUT/vmm_probe_cuda.json" 2> "$OUT/vmm_probe.err"
    echo "probe rc=$?"; cat "$OUT/vmm_probe_cuda.json"
    ;;
  first-kernels)
    timeout 150 python3 -m tools.probe_first_kernels --out "$OUT/first_kernels_cuda.json" 2>&1 | tail -30
    ;;
  prefill-attention)
    timeout 100 python3 -m tools.probe_prefill_attention --out "$OUT/prefill_attention_cuda.json" 2>&1 | cut -c1-600
    ;;
  gemm)
    timeout 280 python3 -m tools.bench_gemm --sweep --out "$OUT/gemm_cuda.json" 2>&1 | tail -24
    ;;
  wide-tiles)
    timeout $(( $(left) < 300 ? $(left) : 300 )) python3 -m tools.bench_gemm --rows 64,128,256 --sweep \
        --sweep-rows 128,256 --shapes qkv,o,gate_up,down --out "$OUT/gemm_wide_cuda.json" 2>&1 | tail -12
    ;;
  gemm-fp8)
    timeout 280 python3 -m tools.bench_gemm --fp8 ${FP8_SCALES:-rows} --sweep --rows 1,8,16,64 \
        --out "$OUT/gemm_fp8_cuda.json" 2>&1 | tail -17
    ;;
  decode)
    model_8b
    timeout $(left) python3 -m tools.bench_decode --model /tmp/l8b --layers fused --batches 1,8,64 \
        --rounds ${ROUNDS:-3} --out "$OUT/decode_cuda.json" 2>&1 | tail -12
    ;;
  decode-256)
    model_8b
    timeout $(left) python3 -m tools.bench_decode --model /tmp/l8b --layers fused --batches 64,128,256 \
        --max-batch 256 --rounds ${ROUNDS:-3} --out "$OUT/decode_cuda_256.json" 2>&1 | tail -12
    ;;
  decode-256-wide)
    # the rows past 64 on the prefill tiles (KVHOLD_WIDE_DECODE_TILES=0), the default (the 64-row decode tile over
    # row blocks to 128 rows) and =1 (to 256) in one call, after their bits (tests/gpu/test_gpu_gemm.py)
    timeout 180 python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/gpu/test_gpu_gemm.py 2>&1 | tail -4
    model_8b
    runs=3
    for wide in 0 "" 1; do
      KVHOLD_WIDE_DECODE_TILES=$wide timeout $(( $(left) / runs-- )) python3 -m tools.bench_decode --model /tmp/l8b --layers fused \
          --batches 64,128,256 --max-batch 256 --rounds ${ROUNDS:-3} --out "$OUT/decode_cuda_256_wide${wide:-default}.json" 2>&1 | tail -7
    done
    ;;
  decode-fp8)
    [ -d /tmp/l8b-fp8 ] || python3 -m kvhold.testing.make_model --preset llama3-8b --quant fp8-dynamic \
        --out /tmp/l8b-fp8 --device cuda 2>&1 | tail -1
    timeout $(left) python3 -m tools.bench_decode --model /tmp/l8b-fp8 --layers fused --batches 1,8,64 \
        --rounds ${ROUNDS:-3} --out "$OUT/decode_fp8_cuda.json" 2>&1 | tail -12
    ;;
  fp8-70b)
    # /dev/shm: the device machines' is 128 GiB (an H100 showed it); a smaller one is grown to 80 GiB if it can
    # be, and shards that still do not fit are spilled to /tmp. FP8_STEPS picks the steps, so that a run split
    # over back-to-back calls on one warm machine keeps the checkpoint between them
    have=$(df --output=size -BG /dev/shm | tail -1 | tr -dc 0-9)
    [ "${have:-0}" -ge 80 ] || mount -o remount,size=80G /dev/shm || echo "fp8-70b: /dev/shm is ${have} GiB and could not grow"
    df -h /dev/shm | tail -1
    steps=" ${FP8_STEPS:-decode prefill recovery cold} "
    # the issue's sizes need an H200 (141 GB). On an 80 GB card the 67.6 GiB checkpoint leaves about 8 GiB, so the
    # decode step runs in a 720-page pool on 64-token prompts and recovery serves 96-192-token prompts in a 4.5 GiB
    # pool with 2,048-token steps; those results are named *_h100 and are not the issue's figures
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    if [ "${gpu_mib:-0}" -ge 100000 ]; then sfx=""; dec_sz=""; rec_sz="--kv-memory 40GiB"
         cold_sz="--kv-pages 8448 --max-seq-len 2304"      # 64 x 2,080 tokens in 16-token pages: 43 GiB
    else sfx="_h100"; dec_sz="--prompt-len 64 --steps 20 --kv-pages 720 --max-seq-len 256"
         rec_sz="--prompt-len 96,192 --max-tokens 32 --max-seq-len 224 --max-batch-tokens 2048 --kv-memory 4.5GiB"
         cold_sz="--prompt-len 96,192 --max-tokens 32 --kv-pages 880 --max-seq-len 224 --max-batch-tokens 2048"
         echo "fp8-70b: a ${gpu_mib} MiB card: reduced sizes, results named *_fp8_70b${sfx}_cuda.json"; fi
    if [ ! -d /dev/shm/l70 ]; then      # a build cut short by a call's limit leaves its temp folder and spills
      rm -rf /dev/shm/.kvhold-model-* /tmp/l70-spill
      build() { S0=$SECONDS; timeout $(left) python3 -m kvhold.testing.make_model --preset llama3-70b-fp8 \
                   --out /dev/shm/l70 --spill-dir /tmp/l70-spill --device cuda 2>&1 | tail -3
                 echo "fp8-70b: build exited $? after $((SECONDS - S0)) s"; }
      if [[ $steps == *" tests "* ]]; then build > "$OUT/build_fp8_70b.txt" & else build; fi
    fi
    for step in $steps; do
      echo "--- fp8-70b $step ($(left) s left)"
      if [ "$step" != tests ] && [ -n "$(jobs -p)" ]; then   # the build, if it ran beside the tests
        wait; cat "$OUT/build_fp8_70b.txt"
      fi
      case "$step" in
      tests) gpu_suite ;;      # while the checkpoint is written (the suite times nothing): one call does both
      decode) timeout $(left) python3 -m tools.bench_decode --model /dev/shm/l70 --layers fused --batches 8,64 \
                  --max-batch 64 --rounds ${ROUNDS:-2} $dec_sz --out "$OUT/decode_fp8_70b${sfx}_cuda.json" 2>&1 | tail -8 ;;
      prefill) timeout $(left) python3 -m tools.bench_prefill --model /dev/shm/l70 --prompts 512,2048,8192 --repeats 2 \
                  --peak-tflops 1979 --out "$OUT/prefill_fp8_70b${sfx}_cuda.json" 2>&1 | tail -6 ;;
      recovery) timeout $(left) python3 -m tools.bench_recovery ${LOAD/\/tmp\/l8b//dev/shm/l70} $rec_sz \
                  --kills ${FP8_KILLS:-10} --tiers standby,zygote --zygote-kills ${FP8_ZYGOTE_KILLS:-3} --cold-kills 0 \
                  --log-level INFO --out "$OUT/recovery_fp8_70b${sfx}_cuda.json" 2>&1 | tail -24 ;;
      cold) timeout $(left) python3 -m tools.bench_cold_restart --model /dev/shm/l70 --runs 1 $cold_sz \
                  --out "$OUT/cold_restart_fp8_70b${sfx}_cuda.json" 2>&1 | tail -4 ;;
      build) ;;
      *) echo "fp8-70b: unknown step $step (tests, build, decode, prefill, recovery, cold)" ;;
      esac
    done
    wait
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  profile)
    model_8b
    timeout $(left) python3 -m tools.profile_decode --model /tmp/l8b --layers fused --batches 8,64 \
        --out "$OUT/decode_profile_cuda.json" 2>&1 | tail -40
    ;;
  recovery)
    model_8b
    timeout $(left) python3 -m tools.bench_recovery $LOAD --kills ${KILLS:-20} --tiers ${TIERS:-standby,zygote} \
        --zygote-kills ${ZYGOTE_KILLS:-3} --cold-kills ${COLD_KILLS:-2} --wait-kills ${WAIT_KILLS:-0} \
        --log-level INFO --out "$OUT/recovery_cuda.json" 2>&1 | tail -30
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  takeover-profile)
    model_8b
    KVHOLD_PROFILE_TAKEOVER="$OUT/takeover_profile_cuda.txt" timeout $(left) python3 -m tools.bench_recovery $LOAD \
        --kills ${PROFILE_KILLS:-3} --tiers standby --lease-ms 30000 --log-level INFO --out "$OUT/recovery_cuda_profiled.json" 2>&1 | tail -14
    ;;
  prefix-cache)
    model_8b
    timeout $(left) python3 -m tools.bench_prefix_cache --device cuda:0 --model /tmp/l8b --streams 64 \
        --prefix-tokens 2048 --suffix-tokens 64,256 --follow-up-tokens 64 --max-tokens 64 --max-seq-len 2560 \
        --max-batch-tokens 8192 --max-batch 64 --kv-memory 40GiB --kills ${PREFIX_KILLS:-5} --log-dir "$OUT" \
        --out "$OUT/prefix_cache_cuda.json" 2>&1 | tail -12
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  checksum)
    timeout $(( $(left) < 240 ? $(left) : 240 )) python3 -m tools.probe_checksum --pages 5700 \
        --out "$OUT/checksum_cuda.json" 2>&1 | tail -20
    ;;
  takeover)
    model_8b
    timeout $(left) python3 -m tools.bench_takeover --device cuda:0 --model /tmp/l8b --requests 64 \
        --prompt-len 512,2048 --kv-pages 12288 --checksum compute --trials ${TAKEOVER_TRIALS:-9} \
        --out "$OUT/takeover_host_cuda.json" 2>&1 | tail -20
    ;;
  mirror)
    model_8b
    timeout 120 python3 -m tools.bench_mirror --model /tmp/l8b --device cuda:0 --batches 8,64 --rounds 2 \
        --out "$OUT/mirror_cuda.json" 2>&1 | tail -6
    timeout $(left) python3 -m tools.bench_recovery $LOAD --kv-mode foreign --kills ${MIRROR_KILLS:-5} \
        --tiers standby --log-level INFO --out "$OUT/recovery_cuda_foreign.json" 2>&1 | tail -14
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  vllm-mirror)
    timeout $(( $(left) < 240 ? $(left) : 240 )) python3 -m tools.bench_vllm_mirror --device cuda:0 \
        --out "$OUT/vllm_bridge_mirror_cuda.json" 2>&1 | tail -24
    ;;
  pool-restart)
    timeout $(left) python3 -m tools.bench_pool_restart --device cuda:0 --restarts 3 \
        --out "$OUT/pool_restart_cuda.json" 2>&1 | tail -30
    ;;
  cold-restart)
    model_8b
    timeout $(left) python3 -m tools.bench_cold_restart --model /tmp/l8b --out "$OUT/cold_restart_cuda.json" 2>&1 | tail -4
    ;;
  prefill)
    model_8b
    variants=(); for v in ${PREFILL_VARIANTS-served: fast:exact_prefill=0 chunk2048fast:prefill_chunk=2048,exact_prefill=0}; do variants+=(--variant "$v"); done
    timeout $(left) python3 -m tools.bench_prefill --model /tmp/l8b --device cuda:0 --prompts 512,2048,8192 \
        --concurrent 1,8 --max-batch-tokens 8192 --profile-prompt 2048 "${variants[@]}" --out "$OUT/prefill_cuda.json" 2>&1 | tail -30
    ;;
  serve)
    model_8b
    python3 -c "import fastapi, uvicorn, httpx" || echo "serve: the HTTP stack does not import (above)"
    timeout $(left) python3 -m tools.bench_serve --model /tmp/l8b --device cuda:0 \
        --concurrency ${SERVE_CONCURRENCY:-1,8,32,64} --rounds ${SERVE_ROUNDS:-2} --prompt-len 512 --max-tokens 128 \
        --kill-concurrency ${SERVE_KILL_C:-32} --serve-args "${SERVE_ARGS:---max-batch-tokens 8192 --kv-memory 24GiB --log-level INFO}" \
        --out "$OUT/serve_cuda.json" 2>&1 | tail -30
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  serve-sharegpt)
    model_8b
    timeout $(left) python3 -m tools.bench_serve --model /tmp/l8b --device cuda:0 \
        --concurrency ${SERVE_CONCURRENCY:-1,8,32,64,128,256} --rounds ${SERVE_ROUNDS:-2} --prompt-len 128,512 \
        --max-tokens 128,384 --kill-concurrency ${SERVE_KILL_C:-256} \
        --serve-args "${SERVE_ARGS:---max-batch 256 --max-batch-tokens 832 --kv-memory 40GiB --log-level INFO}" \
        --out "$OUT/serve_cuda_sharegpt.json" 2>&1 | tail -30
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  serve-budgets)
    # the serving load at each step token budget in SERVE_BUDGETS, with a kill at 64 streams
    model_8b
    for b in ${SERVE_BUDGETS:-8192 2112 1088 832 576}; do
      timeout $(left) python3 -m tools.bench_serve --model /tmp/l8b --device cuda:0 --concurrency 1,8,32,64 \
          --rounds 2 --prompt-len 512 --max-tokens 128 --kill-concurrency 64 \
          --serve-args "--max-batch-tokens $b --kv-memory 24GiB --log-level INFO" \
          --out "$OUT/serve_cuda_budget_$b.json" 2>&1 | tail -3
    done
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  exact)
    timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m pytest -q -n 0 -p no:cacheprovider -rs --durations=5 \
        --tb=short tests/gpu/test_gpu_exact.py > "$OUT/exact_tests.txt" 2>&1
    tail -30 "$OUT/exact_tests.txt"
    timeout $(( $(left) < 60 ? $(left) : 60 )) python3 -m tools.probe_exact --prefill --synthetic-layers 8 --chunks 512 \
        --modes fast,exact,exact_packed --budget-s 30 --out "$OUT/exact_prefill_cuda.json" 2>&1 | tail -16
    ;;
  prefill-tiles)
    timeout $(( $(left) < 300 ? $(left) : 300 )) python3 -m tools.probe_prefill_tiles --budget-s $(( $(left) < 240 ? $(left) - 20 : 220 )) \
        --out "$OUT/prefill_tiles_cuda.json" 2>&1 | tail -60
    ;;
  exact-gemm)
    timeout $(( $(left) < 100 ? $(left) : 100 )) python3 -m tools.probe_exact --gemm --budget-s 70 \
        --out "$OUT/exact_gemm_cuda.json" 2>&1 | tail -40
    ;;
  exact-e2e)
    [ -d /tmp/tiny-bf16 ] || python3 -m tools.probe_exact_recompute --make-bf16 /tmp/tiny-bf16
    CONTROL=${EXACT_CONTROL:+--control}
    timeout $(( $(left) < 50 ? $(left) : 50 )) python3 -m tools.probe_exact_recompute --model /tmp/tiny-bf16 \
        --device cuda:0 --requests 12 --max-tokens 160 $CONTROL --out "$OUT/exact_preemption_cuda.json" 2>&1 | tail -4
    timeout $(( $(left) < 75 ? $(left) : 75 )) python3 -m tools.bench_pool_restart --device cuda:0 \
        --model /tmp/tiny-bf16 --restarts 5 --max-tokens 1200 --sidecar-args "--max-seq-len 1280 --kv-pages 700 --exact-prefill" \
        --out "$OUT/exact_pool_restart_cuda.json" 2>&1 | tail -12
    timeout $(left) python3 -m tools.probe_cuda_fault --model /tmp/tiny-bf16 --trials 3 --requests 8 \
        --max-tokens 48 --log-level WARNING --sidecar-args=--exact-prefill --out "$OUT/exact_cuda_fault_cuda.json" 2>&1 | tail -8
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  exact-fault)
    [ -d /tmp/tiny-bf16 ] || python3 -m tools.probe_exact_recompute --make-bf16 /tmp/tiny-bf16
    timeout $(( $(left) < 75 ? $(left) : 75 )) python3 -m tools.probe_cuda_fault --model /tmp/tiny-bf16 --trials ${FAULT_TRIALS:-3} \
        --requests 8 --max-tokens 48 --log-level WARNING --sidecar-args=--exact-prefill --out "$OUT/exact_cuda_fault_cuda.json" 2>&1 | tail -8
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  cuda-fault)
    [ -d /tmp/tiny ] || python3 -m kvhold.testing.make_model --preset tiny --out /tmp/tiny 2>&1 | tail -1
    timeout $(left) python3 -m tools.probe_cuda_fault --model /tmp/tiny --trials ${FAULT_TRIALS:-5} --requests 8 \
        --out "$OUT/cuda_fault_cuda.json" 2>&1 | tail -40
    gzip -f "$OUT"/*.log 2>/dev/null
    ;;
  sidecar-crash)
    # the 8B model first (the benchmark's load), then the GPU test with what the benchmark leaves
    # (SIDECAR_BENCH_S, default 330 s, kept for it), then the benchmark with the rest
    [ "${SIDECAR_KILLS:-5}" -gt 0 ] && model_8b
    keep=$(( ${SIDECAR_KILLS:-5} > 0 ? ${SIDECAR_BENCH_S:-330} : 0 ))
    t=$(( $(left) - keep )); t=$(( t > 300 ? 300 : t ))
    if [ "$t" -gt 30 ]; then
      timeout $t python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu \
          tests/gpu/test_gpu_sidecar_crash.py 2>&1 | tail -40 | tee "$OUT/pytest_sidecar_crash.txt"
    else
      echo "sidecar-crash: no time for the GPU test ($(left) s left, $keep kept for the benchmark)"
    fi
    if [ "${SIDECAR_KILLS:-5}" -gt 0 ]; then
      timeout $(left) python3 -m tools.bench_sidecar_crash $LOAD --max-tokens ${SIDECAR_MAX_TOKENS:-128} \
          --kills ${SIDECAR_KILLS:-5} --log-level INFO \
          --out "$OUT/sidecar_crash_cuda.json" 2>&1 | tail -30
    fi
    for f in /tmp/pytest-of-*/pytest-*/test_sigkilled_sidecar_on_vmm*[0-9]/*.log /tmp/kvh-crash-*/logs/*.log; do
      [ -f "$f" ] && tail -c 200000 "$f" | gzip > "$OUT/$(basename "$(dirname "$f")")-$(basename "$f").gz"
    done
    ;;
  recovery-tp)
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -lt "${TP:-2}" ]; then
      echo "recovery-tp: TP=${TP:-2} needs ${TP:-2} GPUs, this machine has $gpus" | tee "$OUT/recovery_tp.txt"
    else
      timeout $(left) python3 -m tools.bench_recovery_tp --device cuda --tensor-parallel-size ${TP:-2} \
          --kills ${TP_KILLS:-10} --requests 64 --out "$OUT/recovery_cuda_tp${TP:-2}.json" 2>&1 | tail -30 \
          | tee "$OUT/recovery_tp.txt"
    fi
    ;;
  *)
    echo "unknown phase: $phase (see the head of tools/h200_run.sh)"; exit 2
    ;;
  esac
done
