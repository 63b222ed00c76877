"""Where the two arms of a `cpu_decode_speed.py --mtp 3 --shape 0.8b` run part, how close native's
top two tokens were: one native engine (the benchmark's model, prompts and settings) with
logprobs=2, and each request's first differing position taken from the benchmark's JSON.

    python benchmarks/results/cpu_mtp_speed_2026-12-05/near_ties.py RESULTS.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from cpu_decode_speed import build_model, common_prefix, make_engine  # noqa: E402


def main(path: str) -> None:
    from vllm import SamplingParams

    res = json.load(open(path))
    runs = res["runs"]
    nat = next(r for r in runs if r["arm"] == "native")
    ring = next(r for r in runs if r["arm"] == "ring")
    llm, prompts = make_engine(build_model(res["shape"], res["mtp"]), res["mtp"], res["requests"])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=res["tokens"], ignore_eos=True,
                                                detokenize=False, logprobs=2), use_tqdm=False)
    all_gaps, at_split = [], []
    for i, o in enumerate(outs):
        gaps = []
        for pos in o.outputs[0].logprobs:
            top = sorted((p.logprob for p in pos.values()), reverse=True)
            gaps.append(top[0] - top[1])
        all_gaps += gaps
        split = common_prefix(nat["tokens"][i], ring["tokens"][i])
        same = list(o.outputs[0].token_ids) == nat["tokens"][i]
        at_split.append({"request": i, "first_difference": split, "native_top2_gap_there":
                         gaps[split] if split < len(gaps) else None, "this_run_matches_the_native_arm": same})
    report = {"at_first_difference": at_split,
              "steps": len(all_gaps), "median_top2_gap": statistics.median(all_gaps),
              "fraction_of_steps_gap_below_0.01": sum(g < 0.01 for g in all_gaps) / len(all_gaps),
              "fraction_of_steps_gap_below_0.05": sum(g < 0.05 for g in all_gaps) / len(all_gaps)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
