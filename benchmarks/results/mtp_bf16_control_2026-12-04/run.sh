#!/usr/bin/env bash
# MTP T=3, bf16 SSM state (H200, vLLM 0.33.0), after gpu_run.sh stage x 5, install, fiinstall:
#   bash benchmarks/gpu_run.sh bg mtpc 0 benchmarks/results/mtp_bf16_control_2026-12-04/run.sh
# 1. token agreement of our verify kernel with the native-vs-native control (max_num_seqs 8);
# 2. decode cost with FlashInfer's verify kernel at batch 16 and 64 (FULL graphs), 3 pairs.
set -uo pipefail
rc=0
bash benchmarks/gpu_run.sh mtp16 agree triton || rc=1
BATCHES=16,64 PROFILE= bash benchmarks/gpu_run.sh mtp16 decode flashinfer || rc=1
grep -h "verify kernel\|decode through the ring" "$OUT"/work/*patched*.log 2>/dev/null | sort | uniq -c | head -5
exit $rc
