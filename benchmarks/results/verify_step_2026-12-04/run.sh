#!/usr/bin/env bash
# Next device session (plan from 2026-12-04 18:00): after gpu_run.sh stage x 5, install, fiinstall:
#   bash benchmarks/gpu_run.sh bg next 0 .work/next_session.sh   (carry .work/next_session.sh: .work is ignored)
# 1. GPU tests of the FlashInfer verify path (the ucache bookkeeping kernels, c96ceef) and of our verify;
# 1b. host time per call with real launches (host_overhead.py --cuda): verify launcher, verify_step vs wrapper path;
# 2. agreement of MTP T=3 bf16 through verify_step (390b4bf) with the native control;
# 3. decode cost through verify_step at batch 16 (FULL graph) and 256 (eager, where the host bound);
# 4. the CuTe DSL read probe (cute_read_probe.py), if time is left.
set -uo pipefail
rc=0
KTESTS="tests/gpu/test_ucache_gpu.py tests/gpu/test_flashinfer_verify_gpu.py tests/gpu/test_ring_verify_gpu.py" \
  bash benchmarks/gpu_run.sh ktest > "$OUT/ktest.log" 2>&1 || rc=1
tail -5 "$OUT/ktest.log"
python3 benchmarks/host_overhead.py --cuda --verify 4 --rows 1,16 --calls 500 --out "$OUT/host_overhead_cuda_verify.json" || rc=1
python3 benchmarks/host_overhead.py --cuda --verify-step --rows 1,16 --calls 500 --out "$OUT/host_overhead_cuda_step.json" || rc=1
bash benchmarks/gpu_run.sh cuteprobe || rc=1
bash benchmarks/gpu_run.sh mtp16 agree triton || rc=1
BATCHES=16,256 PROFILE=256 bash benchmarks/gpu_run.sh mtp16 decode triton || rc=1
exit $rc
