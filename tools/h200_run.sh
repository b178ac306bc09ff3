#!/usr/bin/env bash
# What the H200 runs (through the device tool), in phases; results land in $OUT.
#   bash tools/h200_run.sh smoke   GPU tests, VMM probe, a small recovery run
#   bash tools/h200_run.sh bench   Llama-3-8B shapes: decode, cold-restart baseline, recovery
#   bash tools/h200_run.sh verify  the GPU tests (CUDA engine, zygote, NVML health) on the final code
#   bash tools/h200_run.sh tiers   GPU tests, then Llama-3-8B recovery through the zygote and cold tiers
#   bash tools/h200_run.sh recovery  Llama-3-8B recovery, TIERS (default standby,cold)
#   bash tools/h200_run.sh mirror  foreign-pool mode: the mirror's GPU test, then Llama-3-8B: the KV mirror's
#                                  decode cost (batch 1, 8, 64), recovery through the mirror (KILLS, default 10)
#   bash tools/h200_run.sh check   GPU tests, first-kernel probe, 8B decode cost and profile, mirror cost
#   bash tools/h200_run.sh decode  GPU tests, then Llama-3-8B decode cost (fused vs eager layers) and profile
#   bash tools/h200_run.sh gemm    prefill attention's first calls, the skinny GEMM's tile sweep, the GPU tests
#   bash tools/h200_run.sh buckets GPU tests, Llama-3-8B decode cost (skinny GEMM vs cuBLAS) and profile
#   bash tools/h200_run.sh final2  GPU tests, Llama-3-8B decode cost (skinny GEMM vs cuBLAS)
#   bash tools/h200_run.sh recovery2  Llama-3-8B recovery, hot standby and zygote tiers, INFO logs kept
#   bash tools/h200_run.sh mirror2 foreign-pool GPU tests, mirror cost at batch 8 and 64, recovery through the mirror
#   bash tools/h200_run.sh final3  GPU tests, decode cost, a short hot-standby recovery run (pipelined commits)
#   bash tools/h200_run.sh commitcost  decode at batch 8 and 64, commit on/off in ROUNDS alternating windows
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVHOLD_CACHE=/tmp/kvcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
case "${1:-smoke}" in
smoke)
  python3 -m tools.gpu_probe_vmm --size-mb 4096 > "$OUT/vmm_probe.json" 2> "$OUT/vmm_probe.err"; echo "probe rc=$?"
  cat "$OUT/vmm_probe.json"
  timeout 300 python3 -m pytest -x -q tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest_gpu.txt"
  python3 -m kvhold.testing.make_model --preset llama3-8b-4l --out /tmp/l4 --device cuda 2>&1 | tail -2
  timeout 200 python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l4 --requests 16 --prompt-len 256,1024 \
      --max-tokens 32 --max-seq-len 2048 --max-batch-tokens 4096 --kv-memory 8GiB --kills 4 --tiers standby \
      --out "$OUT/recovery_smoke.json" 2>&1 | tail -16
  tail -40 "$OUT"/recovery_smoke.standby.log > "$OUT/recovery_smoke_tail.log" 2>/dev/null
  rm -f "$OUT"/recovery_smoke.standby.log
  ;;
bench)
  python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 200 python3 -m tools.bench_decode --model /tmp/l8b --out "$OUT/decode_cuda.json" 2>&1 | tail -8
  timeout 200 python3 -m tools.bench_cold_restart --model /tmp/l8b --out "$OUT/cold_restart_cuda.json" 2>&1 | tail -4
  ;;
verify)
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_sidecar_health.py \
      -k "recovery or zygote or nvml or context" 2>&1 | tail -30 | tee "$OUT/pytest_gpu.txt"
  timeout 90 python3 -m tools.probe_first_kernels --out "$OUT/first_kernels_cuda.json" 2>&1 | tail -40
  timeout $((${BUDGET_S:-400} - SECONDS)) python3 -m tools.bench_pool_restart --device cuda:0 --restarts 3 \
      --out "$OUT/pool_restart_cuda.json" 2>&1 | tail -30
  ;;
tiers)
  timeout 240 python3 -m pytest -x -q tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/pytest_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout ${TIERS_TIMEOUT:-300} python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --requests 64 --prompt-len 512,2048 \
      --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB --kills ${KILLS:-8} \
      --tiers zygote,cold --cold-kills ${COLD_KILLS:-2} --out "$OUT/recovery_cuda_zygote.json" 2>&1 | tail -30
  for f in "$OUT"/recovery_cuda_zygote.*.log; do tail -80 "$f" > "$f.tail"; rm -f "$f"; done
  ;;
decode)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -30 | tee "$OUT/pytest_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 240 python3 -m tools.bench_decode --model /tmp/l8b --out "$OUT/decode_cuda.json" 2>&1 | tail -30
  timeout 200 python3 -m tools.profile_decode --model /tmp/l8b --out "$OUT/decode_profile_cuda.json" 2>&1 | tail -60
  ;;
check)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_executor_triton_aot.py \
      tests/test_bridge_foreign_pool.py tests/test_bridge_kv_mirror.py 2>&1 | tail -30 | tee "$OUT/pytest_gpu.txt"
  timeout 150 python3 -m tools.probe_first_kernels --out "$OUT/first_kernels_cuda.json" 2>&1 | tail -30
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 100 python3 -m tools.bench_decode --model /tmp/l8b --layers fused --out "$OUT/decode_cuda.json" 2>&1 | tail -12
  timeout 60 python3 -m tools.profile_decode --model /tmp/l8b --layers fused --batches 8,64 \
      --out "$OUT/decode_profile_cuda.json" 2>&1 | tail -30
  timeout $((${BUDGET_S:-580} - SECONDS)) python3 -m tools.bench_mirror --model /tmp/l8b --device cuda:0 \
      --batches 1,8,64 --out "$OUT/mirror_cuda.json" 2>&1 | tail -8
  ;;
final)     # mirror cost, recovery through the mirror, and the native standby tier again with INFO logs
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 150 python3 -m tools.bench_mirror --model /tmp/l8b --device cuda:0 --batches 1,8,64 --rounds 2 \
      --out "$OUT/mirror_cuda.json" 2>&1 | tail -4
  R="--device cuda:0 --model /tmp/l8b --requests 64 --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304
     --max-batch-tokens 8192 --kv-memory 24GiB --tiers standby --log-level INFO"
  timeout 190 python3 -m tools.bench_recovery $R --kv-mode foreign --kills ${KILLS:-8} \
      --out "$OUT/recovery_cuda_foreign.json" 2>&1 | tail -12
  timeout $((${BUDGET_S:-540} - SECONDS)) python3 -m tools.bench_recovery $R --kills ${KILLS:-8} \
      --out "$OUT/recovery_cuda_standby_check.json" 2>&1 | tail -12
  gzip -f "$OUT"/*.log 2>/dev/null
  ;;
last)      # GPU tests of the newest paths, mirror cost, a short native standby run on a cold machine
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_sampler.py tests/test_gpu.py \
      tests/test_bridge_foreign_pool.py -k "sampled or runner or decode_step or bf16" 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 75 python3 -m tools.bench_mirror --model /tmp/l8b --device cuda:0 --batches ${MIRROR_BATCHES:-8,64} --rounds 2 \
      --out "$OUT/mirror_cuda.json" 2>&1 | tail -4
  timeout $((${BUDGET_S:-290} - SECONDS)) python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --requests 64 \
      --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB --tiers standby \
      --log-level INFO --kills ${KILLS:-3} --out "$OUT/recovery_cuda_last.json" 2>&1 | tail -12
  gzip -f "$OUT"/*.log 2>/dev/null
  ;;
gemm)
  timeout 100 python3 -m tools.probe_prefill_attention --out "$OUT/prefill_attention_cuda.json" 2>&1 | cut -c1-600
  timeout 280 python3 -m tools.bench_gemm --sweep --out "$OUT/gemm_cuda.json" 2>&1 | tail -24
  timeout $((${BUDGET_S:-580} - SECONDS)) python3 -m pytest -x -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
      | tail -15 | tee "$OUT/pytest_gpu.txt"
  ;;
buckets)  # decode buckets on the skinny GEMM: GPU tests, then Llama-3-8B decode cost and profile
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemm.py tests/test_gpu.py tests/test_gpu_sampler.py \
      2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 240 python3 -m tools.bench_decode --model /tmp/l8b --layers ${LAYERS:-fused,fused-cublas} --batches 1,8,64 \
      --out "$OUT/decode_cuda.json" 2>&1 | tail -16
  timeout $((${BUDGET_S:-580} - SECONDS)) python3 -m tools.profile_decode --model /tmp/l8b --layers fused \
      --batches 8,64 --out "$OUT/decode_profile_cuda.json" 2>&1 | tail -40
  ;;
final2)   # the final code: GPU tests, then Llama-3-8B decode cost (executor layers vs cuBLAS projections)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemm.py tests/test_gpu.py tests/test_gpu_sampler.py \
      -k "not recovery" 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout $((${BUDGET_S:-300} - SECONDS)) python3 -m tools.bench_decode --model /tmp/l8b --layers fused,fused-cublas \
      --batches 1,8,64 --rounds ${ROUNDS:-3} --out "$OUT/decode_cuda.json" 2>&1 | tail -20
  ;;
recovery2)   # Llama-3-8B recovery on the final code: hot standby (KILLS) and zygote (ZYGOTE_KILLS), INFO logs kept
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout $((${BUDGET_S:-585} - SECONDS)) python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --requests 64 \
      --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB \
      --kills ${KILLS:-20} --tiers ${TIERS:-standby,zygote} --zygote-kills ${ZYGOTE_KILLS:-3} --log-level INFO \
      --out "$OUT/recovery_cuda.json" 2>&1 | tail -30
  gzip -f "$OUT"/*.log 2>/dev/null
  ;;
mirror2)   # foreign-pool mode on the final code: GPU tests, mirror cost at batch 8 and 64, recovery through it
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_bridge_foreign_pool.py tests/test_bridge_kv_mirror.py \
      -m gpu 2>&1 | tail -12 | tee "$OUT/pytest_mirror_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 120 python3 -m tools.bench_mirror --model /tmp/l8b --device cuda:0 --batches 8,64 --rounds 2 \
      --out "$OUT/mirror_cuda.json" 2>&1 | tail -6
  timeout $((${BUDGET_S:-540} - SECONDS)) python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --kv-mode foreign \
      --requests 64 --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB \
      --kills ${KILLS:-5} --tiers standby --log-level INFO --out "$OUT/recovery_cuda_foreign.json" 2>&1 | tail -14
  gzip -f "$OUT"/*.log 2>/dev/null
  ;;
final3)   # the final code with pipelined commits: GPU tests, decode cost, a short hot-standby recovery run
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemm.py tests/test_gpu.py tests/test_gpu_sampler.py \
      2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout 120 python3 -m tools.bench_decode --model /tmp/l8b --layers fused --batches 1,8,64 --rounds 3 \
      --out "$OUT/decode_cuda.json" 2>&1 | tail -12
  timeout $((${BUDGET_S:-440} - SECONDS)) python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --requests 64 \
      --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB \
      --kills ${KILLS:-8} --tiers standby --log-level INFO --out "$OUT/recovery_cuda_pipelined.json" 2>&1 | tail -14
  gzip -f "$OUT"/*.log 2>/dev/null
  ;;
commitcost)   # decode at batch 8 and 64, commit on and off in ROUNDS alternating windows
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout $((${BUDGET_S:-200} - SECONDS)) python3 -m tools.bench_decode --model /tmp/l8b --layers fused --batches 8,64 \
      --rounds ${ROUNDS:-8} --out "$OUT/decode_cuda_commit_cost.json" 2>&1 | tail -12
  ;;
recovery)
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout $((${BUDGET_S:-585} - SECONDS)) python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --requests 64 --prompt-len 512,2048 \
      --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB --kills ${KILLS:-20} \
      --tiers ${TIERS:-standby,cold} --cold-kills ${COLD_KILLS:-3} --wait-kills ${WAIT_KILLS:-0} \
      --zygote-kills ${ZYGOTE_KILLS:-0} --out "$OUT/recovery_cuda.json" 2>&1 | tail -40
  for f in "$OUT"/recovery_cuda.*.log; do tail -60 "$f" > "$f.tail"; rm -f "$f"; done
  ;;
mirror)   # MIRROR_TESTS="bf16 or token_exact" also runs the tiny-model sidecar kill test (~1 min more)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_bridge_foreign_pool.py -m gpu \
      -k "${MIRROR_TESTS:-bf16}" 2>&1 | tail -20 | tee "$OUT/pytest_mirror_gpu.txt"
  [ -d /tmp/l8b ] || python3 -m kvhold.testing.make_model --preset llama3-8b --out /tmp/l8b --device cuda 2>&1 | tail -1
  timeout ${MIRROR_TIMEOUT:-200} python3 -m tools.bench_mirror --model /tmp/l8b --device cuda:0 --batches 1,8,64 \
      --out "$OUT/mirror_cuda.json" 2>&1 | tail -8
  timeout $((${BUDGET_S:-585} - SECONDS)) python3 -m tools.bench_recovery --device cuda:0 --model /tmp/l8b --kv-mode foreign \
      --requests 64 --prompt-len 512,2048 --max-tokens 64 --max-seq-len 2304 --max-batch-tokens 8192 --kv-memory 24GiB \
      --kills ${KILLS:-10} --tiers standby --out "$OUT/recovery_cuda_foreign.json" 2>&1 | tail -20
  for f in "$OUT"/recovery_cuda_foreign.*.log; do tail -60 "$f" > "$f.tail"; rm -f "$f"; done
  ;;
esac
