"""The tiny random-weight checkpoint builder (replayssm_patch.testing.tiny_models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replayssm_patch.testing import cache_dir, require_module
from replayssm_patch.testing.tiny_models import build_tiny_model, content_key, tiny_model_config

CACHE = cache_dir() / "tiny-models"


@pytest.fixture(scope="module")
def load():
    require_module("transformers")
    safetensors = require_module("safetensors.torch")
    return lambda path: safetensors.load_file(str(Path(path) / "model.safetensors"))


def test_configs():
    c = tiny_model_config("qwen3_5")
    assert c["architectures"] == ["Qwen3_5ForCausalLM"] and c["model_type"] == "qwen3_5_text"
    assert c["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert "num_experts" not in c and "mtp_num_hidden_layers" not in c
    n = tiny_model_config("qwen3_next", gdn_head_dim=64, num_hidden_layers=8)
    assert n["architectures"] == ["Qwen3NextForCausalLM"] and n["model_type"] == "qwen3_next"
    assert n["layer_types"][3] == n["layer_types"][7] == "full_attention"
    assert n["mlp_only_layers"] == list(range(7)), "vLLM needs >= 1 MoE layer: the last one"
    assert n["linear_key_head_dim"] == n["linear_value_head_dim"] == 64
    assert tiny_model_config("qwen3_5", mtp_layers=2)["mtp_num_hidden_layers"] == 2
    assert tiny_model_config("qwen3_5", vocab_size=512)["vocab_size"] == 512
    q4 = tiny_model_config("qwen4_exp", ple_layer_ids=[2])
    assert q4["architectures"] == ["Qwen4ExpForCausalLM"] and q4["model_type"] == "qwen4_exp_text"
    assert q4["ple_layer_ids"] == [2] and q4["hc_count"] == 2 and "indexer_n_heads" not in q4
    with pytest.raises(ValueError, match="gdn_head_dim"):
        tiny_model_config("qwen3_5", gdn_head_dim=32)
    with pytest.raises(ValueError, match="arch"):
        tiny_model_config("llama")
    with pytest.raises(ValueError, match="mtp_layers"):
        tiny_model_config("qwen3_next", mtp_layers=1)
    assert content_key(c, 0, 0.02) != content_key(c, 1, 0.02) != content_key(n, 0, 0.02)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_checkpoint_content(load, arch):
    path = build_tiny_model(CACHE, arch=arch)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg == {**tiny_model_config(arch), "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    w = load(path)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    assert emb.shape == head.shape == (1024, 256)
    assert not torch.equal(emb, head), "embedding and LM head must differ (vLLM dummy weights tie them)"
    K = V = 128
    for i in range(3):  # GDN layers
        p = f"model.layers.{i}.linear_attn."
        assert w[p + "A_log"].shape == w[p + "dt_bias"].shape == (4,)
        assert w[p + "conv1d.weight"].shape == (2 * 2 * K + 4 * V, 1, 4)
        assert torch.isfinite(w[p + "A_log"].float()).all()
    assert "model.layers.3.self_attn.q_proj.weight" in w
    moe = [k for k in w if ".mlp.experts." in k]
    if arch == "qwen3_next":
        assert moe and all(k.startswith("model.layers.3.") for k in moe)
    else:
        assert not moe and "model.layers.0.mlp.gate_proj.weight" in w
    assert not any(k.startswith("mtp.") for k in w)


def test_cache_reuse_determinism_and_rng(load, tmp_path):
    a = build_tiny_model(CACHE, arch="qwen3_5", gdn_head_dim=64)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    rng = torch.get_rng_state()
    again = build_tiny_model(CACHE, arch="qwen3_5", gdn_head_dim=64)
    assert again == a and (a / "model.safetensors").stat().st_mtime_ns == stamp, "cached build not reused"
    elsewhere = build_tiny_model(tmp_path, arch="qwen3_5", gdn_head_dim=64)
    assert torch.equal(torch.get_rng_state(), rng), "the builder must not disturb the global RNG"
    wa, we = load(a), load(elsewhere)
    assert wa.keys() == we.keys() and all(torch.equal(wa[k], we[k]) for k in wa), "same seed, other weights"
    other = build_tiny_model(tmp_path, arch="qwen3_5", gdn_head_dim=64, seed=1)
    assert other != elsewhere
    assert not torch.equal(load(other)["lm_head.weight"], wa["lm_head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([elsewhere.name, other.name]), "leftovers"


def test_mtp_weights(load):
    path = build_tiny_model(CACHE, arch="qwen3_5", mtp_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    w = load(path)
    assert w["mtp.fc.weight"].shape == (256, 512)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        assert w[f"mtp.{norm}.weight"].shape == (256,)
    full = {k.removeprefix("model.layers.3."): v for k, v in w.items() if k.startswith("model.layers.3.")}
    mtp = {k.removeprefix("mtp.layers.0."): v for k, v in w.items() if k.startswith("mtp.layers.0.")}
    assert mtp.keys() == full.keys()
    assert all(mtp[k].shape == full[k].shape for k in mtp)
    assert not torch.equal(mtp["self_attn.q_proj.weight"], full["self_attn.q_proj.weight"])
