"""Run real vLLM on a set of scenarios and print what it generated, as JSON on the last line.

Used by the tests and the demo to compare native and patched engines, each arm in its own
process (`python -m replayssm_patch.testing.engine_runner SPEC.json`). The spec:

    {"model": path, "patched": bool, "ring_len": int, "min_batch": int | "auto" (default 1),
     "allow_mtp": bool (default False),
     "via": "patch" | "env" | "flag",
     "cursor_per_bind": bool (optional, in process only: every bind gets a fresh cursor, as the
                       layer did before it kept the cursor across vLLM 0.34's rebind; a test
                       shows that this breaks CUDA graphs captured before the rebind),
     "pool_prefill_unvalidated": bool (optional, in process only: ring layers run FlashInfer's
                       prefill on the state pool in this release before a GPU run validated it,
                       which is what the run that validates it needs: vllm.flashinfer_pool_prefill),
     "engines": [{"name": str, "engine": {LLM kwargs}, "scenario": "batch" | "staggered",
                  "prompts": [[token ids] | {"ids": [...], "image_seed": int}...],
                  "max_tokens": [int...],
                  "model": path (optional, replaces the spec's),
                  "followups": {"prompts": [[ids] | {"from": i, "take": n, "then": [ids]}...],
                                "max_tokens": [int...]} (optional: sent after the scenario, served
                               from the prefix cache, then again after llm.reset_prefix_cache();
                               {"from": i, ...}: the first n tokens of request i's prompt and
                               generated tokens, then `then`; entry "followups": {"cached",
                               "reset" (requests as "requests"), and each one's cached token
                               counts}),
                  "memory_check": bool (optional: testing.memory_check's report per worker, last),
                  "teacher_forced": {"save": path, "tokens": [[ids]...] | None,
                                     "tokens_from": engine name | None} (optional)}]}

"via": "patch" calls replayssm_patch.patch() with the spec's options; "env" leaves it to the
plugin and the environment; "flag" to the engines' own kwargs (`use_replayssm=True`,
`replayssm_buffer_len`: vLLM's switch, replayssm_patch.vllm.replayssm_flag).
"batch" submits every prompt at once; "staggered" adds one request per engine step, so new
prefills share steps with running decodes (mixed batches). "teacher_forced" records every
position's logprobs (testing.teacher_forced) into `save`, forcing the given tokens, or those an
earlier engine of this run generated (`tokens_from`), or none (record only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _gdn_layers_info(model):
    """Per GDN layer: class, whether it has a ring, cache content bytes per slot."""
    from vllm.config import get_current_vllm_config  # noqa: F401

    info = []
    for name, mod in model.named_modules():
        if type(mod).__name__ in ("ReplayQwenGDN", "QwenGatedDeltaNetAttention"):
            ring = getattr(mod, "replay_ring", None)
            kv = getattr(mod, "kv_cache", None)
            content = sum(t[0].numel() * t.element_size() for t in kv) if kv else 0
            if ring is not None:
                content += sum(t[0].numel() * t.element_size() for t in (ring.g, ring.d, ring.k))
            info.append({"name": name, "cls": type(mod).__name__, "ring": ring is not None,
                         "content_bytes_per_slot": content,
                         # slots whose ring holds entries right now: the ring really carries state
                         "slots_with_ring_entries": int((ring.cursor > 0).sum()) if ring is not None else 0})
    return info


def _ring_counters_in_worker(model):
    """This worker's ring counters (apply_model passes the model; the counters are per process,
    so with several ranks each rank reports its own)."""
    from replayssm_patch.state import STATE

    return dict(STATE.stats)


def _prompt(p) -> dict:
    """A prompt of the spec: token ids, or {"ids": [...], "image_seed": int} for a
    vision-language model (ids holding one image placeholder, a random 64 x 64 RGB image)."""
    if isinstance(p, list):
        return {"prompt_token_ids": p}
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(p["image_seed"]).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return {"prompt_token_ids": p["ids"], "multi_modal_data": {"image": Image.fromarray(pixels)}}


def _top2(lp_dict):
    items = sorted(lp_dict.items(), key=lambda kv: -kv[1].logprob)[:2]
    return [[int(t), float(lp.logprob)] for t, lp in items]


def _collect(outputs):
    res = []
    for o in sorted(outputs, key=lambda o: int(o.request_id)):
        c = o.outputs[0]
        chosen = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
        res.append({"tokens": list(c.token_ids), "logprobs": chosen,
                    "top2": [_top2(d) for d in c.logprobs], "prompt_len": len(o.prompt_token_ids)})
    return res


def _followups(llm, spec, prompts, requests) -> dict:
    """The follow-up prompts' greedy tokens, served from the prefix cache the scenario filled
    ("cached"), then from an emptied one ("reset")."""
    from vllm import SamplingParams

    def ids(p):
        if isinstance(p, dict) and "from" in p:
            seq = list(prompts[p["from"]]) + list(requests[p["from"]]["tokens"])
            return seq[:p["take"]] + list(p["then"])
        return p

    prompts = [_prompt(ids(p)) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False, logprobs=2)
              for n in spec["max_tokens"]]
    out = {}
    for arm in ("cached", "reset"):
        if arm == "reset":
            assert llm.reset_prefix_cache(), "the prefix cache did not reset"
        outs = llm.generate(prompts, params, use_tqdm=False)  # in prompt order
        out[arm + "_cached_tokens"] = [int(o.num_cached_tokens or 0) for o in outs]
        for i, o in enumerate(outs):
            o.request_id = str(i)
        out[arm] = _collect(outs)
    return out


def _run_staggered(llm, prompts, params):
    engine = llm.llm_engine
    pending = list(enumerate(zip(prompts, params)))
    done = []
    while pending or engine.has_unfinished_requests():
        if pending:
            i, (p, sp) = pending.pop(0)
            engine.add_request(str(i), p, sp)
        for out in engine.step():
            if out.finished:
                done.append(out)
    return done


def _preemptions(llm) -> int | None:
    try:
        for m in llm.get_metrics():
            if "preempt" in m.name:
                return int(getattr(m, "value", 0) or 0)
    except Exception:
        return None
    return 0


def spec_decode_metrics(llm) -> dict | None:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted
    per draft position), or None when the engine has none."""
    out = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_"):
                key = m.name[len("vllm:spec_decode_"):]
                out[key] = list(m.values) if hasattr(m, "values") else int(getattr(m, "value", 0) or 0)
    except Exception:
        return None
    return out or None


def _gdn_cache_bytes(llm) -> dict | None:
    """GDN cache bytes per request as the engine allocates them (in-process engines only):
    for each Mamba KV-cache group, layers x MambaSpec.max_memory_usage_bytes (the padded page
    times 1 + num_speculative_blocks in mode none), and the unpadded content the same way."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        cfg, vllm_config = core.scheduler.kv_cache_config, core.vllm_config
    except AttributeError:
        return None
    from vllm.v1.kv_cache_interface import MambaSpec

    total = content = layers = 0
    nsb = set()
    for group in cfg.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            n = len(group.layer_names)
            layers += n
            total += n * spec.max_memory_usage_bytes(vllm_config)
            content += n * spec.state_content_size_bytes * (1 + spec.num_speculative_blocks)
            nsb.add(spec.num_speculative_blocks)
    return {"bytes_per_request": total, "content_bytes_per_request": content, "layers": layers,
            "num_speculative_blocks": sorted(nsb)}


def replayssm_patch_status(llm) -> dict:
    import replayssm_patch

    report = replayssm_patch.status(llm)
    return {"layers": report["layers"], "counters": report["counters"], "workers": len(report.get("workers", []))}


def _ring_counters(spec) -> dict:
    if not spec["patched"]:
        return {}
    from replayssm_patch.state import STATE

    return dict(STATE.stats)


def arm_env(workdir, mp: bool, extra=None) -> dict:
    """The environment of one arm's process: in process (mp=False) or vLLM's multiprocessing,
    with the shadow check and poisoned rings on (testing aids, inert unless the patch is on) and
    VLLM_GDN_REPLAYSSM removed unless `extra` sets it."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1" if mp else "0",
               VLLM_GDN_REPLAYSSM_SHADOW="1", VLLM_GDN_REPLAYSSM_POISON_UNUSED="1")
    env.setdefault("VLLM_CACHE_ROOT", str(Path(workdir) / "vllm-cache"))
    env.pop("VLLM_GDN_REPLAYSSM", None)
    env.update(extra or {})
    return env


def portable_cpu_conv_env() -> dict:
    """`extra_env` for an arm whose vLLM-CPU processes take the portable GDN conv path on every host
    (why: portable_cpu_conv/sitecustomize.py)."""
    folder = str(Path(__file__).parent / "portable_cpu_conv")
    return {"PYTHONPATH": os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)}


def run_arm(workdir, name: str, spec: dict, mp: bool = False, extra_env=None) -> tuple[dict, str]:
    """Run `spec` in a fresh process (`python -m replayssm_patch.testing.engine_runner`); returns
    its result and its log (stdout then stderr: `workdir/name.out.log` and `name.err.log`,
    written while it runs, so a run cut off still shows how far it got). A failed run raises."""
    path = Path(workdir) / f"{name}.json"
    path.write_text(json.dumps(spec))
    out_path, err_path = Path(workdir) / f"{name}.out.log", Path(workdir) / f"{name}.err.log"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "replayssm_patch.testing.engine_runner", str(path)],
                              env=arm_env(workdir, mp, extra_env), stdout=out, stderr=err, timeout=1200, check=False)
    stdout = out_path.read_text()
    log = stdout + err_path.read_text()
    assert proc.returncode == 0, f"{name} failed:\n{log[-4000:]}"
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1]
    return json.loads(line[len("RESULT_JSON "):]), log


def fresh_cursor(layer, pages):
    """`ReplayQwenGDN._cursor_for` as it was before the cursor was kept across rebinds: a new,
    empty cursor at every bind, at a new address (a test's stand-in for the old behaviour). The
    earlier cursors stay referenced: freed, the caching allocator hands the same block straight
    back to the next bind's allocation of the same size, and the old bind then worked by chance
    (vLLM 0.34 on an H200, benchmarks/results/vllm034/README.md); a rebind over fewer blocks, or
    any allocation in between, moves it."""
    import torch

    cursor = torch.zeros(pages.shape[0], dtype=torch.int32, device=pages.device)
    layer.__dict__.setdefault("_earlier_cursors", []).append(cursor)
    return cursor, False


def _require_engine_in_process(key: str) -> None:
    """The spec's `key` changes the package in this process, so the engine must run in it too."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        raise RuntimeError(f"{key} needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")


def _fresh_cursor_at_every_bind() -> None:
    """The spec's `cursor_per_bind`: every bind gets a fresh cursor (fresh_cursor)."""
    _require_engine_in_process("cursor_per_bind")
    from replayssm_patch.vllm.gdn_layer import ReplayQwenGDN

    ReplayQwenGDN._cursor_for = fresh_cursor


def _pool_prefill_in_this_release() -> None:
    """The spec's `pool_prefill_unvalidated`: this release counts as validated for the pool form."""
    _require_engine_in_process("pool_prefill_unvalidated")
    from replayssm_patch import versions

    versions.FLASHINFER_POOL_PREFILL_VALIDATED += (versions.installed_base_version(),)


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    if spec["patched"] and spec.get("via", "patch") == "patch":
        import replayssm_patch

        # min_batch 1 unless the spec says otherwise: "auto" keeps plain decode native (CPU; CUDA, fp32 state)
        report = replayssm_patch.patch(ring_len=spec.get("ring_len", 16), strict=spec.get("strict", True),
                                       ring_dtype=spec.get("ring_dtype", "auto"),
                                       min_batch=spec.get("min_batch", 1),
                                       allow_mtp="ring" if spec.get("allow_mtp") else "native")
        assert report["applied"], report
    if spec.get("cursor_per_bind"):
        _fresh_cursor_at_every_bind()
    if spec.get("pool_prefill_unvalidated"):
        _pool_prefill_in_this_release()
    from vllm import LLM, SamplingParams

    results = {}
    for eng in spec["engines"]:
        before = _ring_counters(spec)
        forced = eng.get("teacher_forced")
        kwargs = dict(eng["engine"])
        if forced is not None:
            from replayssm_patch.testing import teacher_forced

            kwargs["logits_processors"] = [teacher_forced.processor_for(eng.get("model", spec["model"]), kwargs)]
            tokens = forced.get("tokens")
            if forced.get("tokens_from"):
                tokens = [r["tokens"] for r in results[forced["tokens_from"]]["requests"]]
            keys = [f"{eng['name']}/{i}" for i in range(len(eng["prompts"]))]
        llm = LLM(model=eng.get("model", spec["model"]), **kwargs)
        prompts = [_prompt(p) for p in eng["prompts"]]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False, logprobs=2,
                                 extra_args=None if forced is None else
                                 teacher_forced.sampling_extra(keys[i], None if tokens is None else tokens[i]))
                  for i, n in enumerate(eng["max_tokens"])]
        if eng.get("scenario", "batch") == "staggered":
            outs = _run_staggered(llm, prompts, params)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            # request ids restart per LLM; generate() already returns prompt order
            for i, o in enumerate(outs):
                o.request_id = str(i)
        entry = {"requests": _collect(outs), "preemptions": _preemptions(llm)}
        if eng.get("followups"):
            entry["followups"] = _followups(llm, eng["followups"], eng["prompts"], entry["requests"])
        if eng["engine"].get("speculative_config"):
            entry["spec_decode"] = spec_decode_metrics(llm)
            entry["gdn_cache"] = _gdn_cache_bytes(llm)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            per_rank = llm.apply_model(_gdn_layers_info)
            entry["layers"] = per_rank[0]
            if len(per_rank) > 1:  # tensor parallel: every rank's layers, and its own ring counters
                entry["layers_per_rank"] = per_rank
                if spec["patched"]:
                    entry["ring_counters_per_rank"] = llm.apply_model(_ring_counters_in_worker)
        if spec["patched"]:  # what this engine alone did on the ring, and each layer's decision
            after = _ring_counters(spec)
            entry["ring_counters"] = {k: v - before.get(k, 0) for k, v in after.items()}
            import replayssm_patch

            entry["layer_decisions"] = replayssm_patch.status()["layers"]
        if spec["patched"]:  # what the user's status(llm) shows: the workers' own report
            entry["engine_status"] = replayssm_patch_status(llm)
        if forced is not None:  # after the counters: it runs one more (one-token) request
            import torch

            records = teacher_forced.collect(llm, forced["save"] + ".records")
            torch.save([records[k] for k in keys], forced["save"])
        if eng.get("memory_check"):  # last: it leaves the engine without a KV cache
            from replayssm_patch.testing.memory_check import cache_memory_report

            entry["memory"] = llm.collective_rpc(cache_memory_report)
        results[eng["name"]] = entry
        del llm
    if spec["patched"]:
        try:
            import replayssm_patch

            results["_status"] = replayssm_patch.status()
        except Exception as e:  # pragma: no cover - reported, not hidden
            results["_status"] = {"error": repr(e)}
    print("RESULT_JSON " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
