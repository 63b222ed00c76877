#!/usr/bin/env bash
# Issue 23: MTP T=3 end to end with the verify step on FlashInfer's kernel, bf16 state, vLLM's
# default config. First the decode cost (3 interleaved pairs), then token agreement.
set -uo pipefail
export VLLM_GDN_REPLAYSSM_MTP_KERNEL=flashinfer VLLM_GDN_REPLAYSSM_16BIT_STATE=1
rc=0
python3 benchmarks/e2e_decode.py --mtp 3 --state-dtype bfloat16 --batches 16,64,256 --repeats 1 \
  --order ABBAAB --profile-batches 256 --out "$OUT/e2e_decode_mtp3_fi.json" --workdir "$OUT/work" 2>&1 | tail -40 || rc=1
grep -h "verify kernel\|decode through the ring" "$OUT"/work/*patched.log | sort | uniq -c | head -5
python3 benchmarks/e2e_agreement.py --mtp 3 --tag mtp3_fi --out "$OUT/e2e_agreement_mtp3_fi.json" --workdir /tmp/mtpfi \
  --states bfloat16 --requests 16 --tokens 128 --no-control 2>&1 | tail -30 || rc=1
for f in /tmp/mtpfi/*.log; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
exit $rc
