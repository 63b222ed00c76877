#!/usr/bin/env bash
# MTP T=3 agreement, bf16 state, the patched arm's verify step on FlashInfer's kernel
cd /work/main 2>/dev/null || cd "$REPO"
export VLLM_GDN_REPLAYSSM_16BIT_STATE=1 VLLM_GDN_REPLAYSSM_MTP_KERNEL=flashinfer
python3 benchmarks/e2e_agreement.py --mtp 3 --tag mtp3_fi --out "$OUT/e2e_agreement_mtp3_fi.json" --workdir /tmp/mtpfi \
  --states bfloat16 --requests 8 --tokens 64 --no-control 2>&1 | tail -30
rc=${PIPESTATUS[0]}
cp /tmp/mtpfi/*.log "$OUT/" 2>/dev/null
exit $rc
