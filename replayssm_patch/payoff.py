"""Whether the ring pays for plain decode: a step-time model from the model's shapes and the
measured kernel table, and the engine's concurrency with the ring's memory.

Pure arithmetic on `ModelFacts` (what vLLM's config says about the model and the engine) and
the tables in `data/plan_tables.json` (written by benchmarks/make_plan_tables.py from committed
results). The rule, per decode batch b:

    step(b)   = max(weight bytes read / bandwidth, matrix FLOPs / rate)   the linear layers
              + attention KV read at half of max_model_len / bandwidth
              + GDN layers x vLLM's kernel time at b (the kernel table)
    saved(b)  = GDN layers x (vLLM's kernel time - the ring's) at b
    gain(b)   = step(b) / (step(b) - saved(b)) - 1

The model assumes the GPU is what the step waits on, so gain(b) is an upper bound; the ring
serves plain decode from the smallest batch from which every gain(b) up to max_num_seqs reaches
the table's `min_predicted_gain` (set from end-to-end runs: docs/performance.md), and only if the
engine still holds max_num_seqs requests of max_model_len tokens with the ring's pages and the
GDN prefill step its memory profile adds (`prefill_step_bytes`).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from dataclasses import dataclass

_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "plan_tables.json")
GIB = 1 << 30


@functools.lru_cache(maxsize=1)
def tables() -> dict:
    with open(_TABLES) as f:
        return json.load(f)


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know of the model and the engine (per tensor-parallel rank)."""

    gdn_layers: int
    attention_layers: int
    state_bytes_per_slot: int  # one GDN layer's SSM state, one cache slot
    conv_bytes_per_slot: int
    kv_bytes_per_token: int  # one attention layer, K and V
    qkv_bytes_per_token: int  # one GDN layer's q/k/v in-projection output for one token
    weight_bytes: int  # every weight, as stored
    dense_weight_bytes: int  # read every step whatever the batch (all but the routed experts)
    expert_bytes: int  # one routed expert of one layer
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    moe_layers: int
    active_params: int  # multiply-adds per token
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    memory_bytes: int  # what the engine may use: gpu_memory_utilization x the GPU's memory
    align: bool  # prefix caching in align mode (two state pages per request)

    def weight_bytes_read(self, batch: int) -> float:
        if not self.experts:
            return self.dense_weight_bytes
        # experts one step touches: each token picks experts_per_token of them
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** batch)
        return self.dense_weight_bytes + self.moe_layers * touched * self.expert_bytes


def facts_from_hf_config(hf, *, tp: int, weight_bytes_per_param: float, activation_bytes: int,
                         kv_bytes_per_element: int, state_bytes_per_slot: int, max_num_seqs: int,
                         max_num_batched_tokens: int, max_model_len: int, memory_bytes: int,
                         align: bool) -> ModelFacts:
    """ModelFacts of a Qwen3.5 / Qwen3-Next style config (`hf`: the text config's attributes),
    per tensor-parallel rank: parameter counts of the GDN, attention and MLP / MoE layers and the
    LM head, as stored."""
    types = list(getattr(hf, "layer_types", None) or ["linear_attention"] * hf.num_hidden_layers)
    n_gdn = types.count("linear_attention")
    n_attn = len(types) - n_gdn
    hidden = hf.hidden_size
    H, HV = hf.linear_num_key_heads, hf.linear_num_value_heads
    K, V = hf.linear_key_head_dim, hf.linear_value_head_dim
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hidden // heads
    gate = 2 if getattr(hf, "attn_output_gate", True) else 1  # Qwen3.5 / Next: q_proj also gives the gate
    attn = hidden * heads * head_dim * (gate + 1) + 2 * hidden * kv_heads * head_dim
    gdn = hidden * (2 * H * K + 2 * HV * V + 2 * HV) + HV * V * hidden
    experts = int(getattr(hf, "num_experts", 0) or 0)
    if experts:
        expert = 3 * hidden * hf.moe_intermediate_size
        mlp_dense = 3 * hidden * int(getattr(hf, "shared_expert_intermediate_size", 0) or 0) + hidden * experts
        top_k = int(hf.num_experts_per_tok)
    else:
        expert, mlp_dense, top_k = 0, 3 * hidden * hf.intermediate_size, 0
    layers = n_gdn + n_attn
    dense = n_attn * attn + n_gdn * gdn + layers * mlp_dense + hf.vocab_size * hidden  # + the LM head
    embed = 0 if getattr(hf, "tie_word_embeddings", False) else hf.vocab_size * hidden
    per_rank = weight_bytes_per_param / tp
    return ModelFacts(
        gdn_layers=n_gdn, attention_layers=n_attn, state_bytes_per_slot=state_bytes_per_slot,
        conv_bytes_per_slot=(2 * H * K + HV * V) // tp * (int(getattr(hf, "linear_conv_kernel_dim", 4)) - 1)
        * activation_bytes,
        kv_bytes_per_token=2 * max(kv_heads // tp, 1) * head_dim * kv_bytes_per_element,
        qkv_bytes_per_token=(2 * H * K + HV * V) // tp * activation_bytes,
        weight_bytes=int((dense + embed + layers * experts * expert) * per_rank),
        dense_weight_bytes=int(dense * per_rank), expert_bytes=int(expert * per_rank),
        experts=experts, experts_per_token=top_k, moe_layers=layers if experts else 0,
        active_params=(dense + layers * top_k * expert) // tp, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, memory_bytes=memory_bytes,
        align=align)


def _interp(points: list, x: float, column: int) -> float:
    """The kernel time at `x` state bytes: log-log interpolation between measured points,
    proportional to bytes beyond the largest (the kernels are bandwidth-bound there)."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][column]
    if i == len(points):
        return points[-1][column] * x / xs[-1]
    (x0, *a), (x1, *b) = points[i - 1], points[i]
    y0, y1 = a[column - 1], b[column - 1]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def kernel_us(state_dtype: str, ring_dtype: str, state_bytes: float, measured: dict | None = None) -> tuple[float, float]:
    """(vLLM's, the ring's) decode kernel time per layer-step for `state_bytes` of state
    (`measured`: tables to read instead of the package's)."""
    points = (measured or tables())["kernels"]["curves"][f"{state_dtype}/{ring_dtype}"]
    return _interp(points, state_bytes, 1), _interp(points, state_bytes, 2)


def predicted_gain(facts: ModelFacts, state_dtype: str, ring_dtype: str, batch: int,
                   measured: dict | None = None) -> float:
    """gain(batch) of the module docstring (`measured`: tables to read instead of the package's)."""
    dev = (measured or tables())["device"]
    bw = dev["copy_bandwidth_TBps"] * 1e12
    linear = max(facts.weight_bytes_read(batch) / bw, 2 * facts.active_params * batch / (dev["matmul_tflops"] * 1e12))
    attention = facts.attention_layers * batch * (facts.max_model_len / 2) * facts.kv_bytes_per_token / bw
    native, ring = kernel_us(state_dtype, ring_dtype, batch * facts.state_bytes_per_slot, measured)
    step = linear + attention + facts.gdn_layers * native * 1e-6
    saved = facts.gdn_layers * (native - ring) * 1e-6
    return step / (step - saved) - 1


def plain_decode_min_batch(facts: ModelFacts, state_dtype: str, ring_dtype: str) -> tuple[int | None, float, int]:
    """(smallest batch the ring serves or None, the best predicted gain, its batch), over the
    powers of two up to max_num_seqs and max_num_seqs itself."""
    need = tables()["rule"]["min_predicted_gain"]
    batches = sorted({1 << i for i in range(max(facts.max_num_seqs, 1).bit_length())} | {facts.max_num_seqs})
    gains = [(predicted_gain(facts, state_dtype, ring_dtype, b), b) for b in batches]
    best = max(gains)
    start = None
    for gain, b in reversed(gains):  # the ring must pay at every batch from `start` up
        if gain < need:
            break
        start = b
    return start, best[0], best[1]


def prefill_step_bytes(facts: ModelFacts, state_dtype: str, seqs: int, spec_decode: bool = False) -> float:
    """What one GDN prefill step of max_num_batched_tokens tokens over `seqs` sequences holds above
    its input (the step a ring engine's memory profile adds: vllm/prefill_profile.py), from the
    table's line through the measured steps (fp16 states read bf16's), plus, where the engine
    speculates (`spec_decode`), the copy of the step's q/k/v that vLLM keeps beside verify rows. The
    line is the step in one call; where ring layers run it per group (vllm/prefill_groups.py) it
    is smaller, so there the estimate errs toward fewer requests."""
    lines = tables()["prefill_step"]
    line = lines.get(state_dtype, lines["bf16"])
    copy = facts.max_num_batched_tokens * facts.qkv_bytes_per_token if spec_decode else 0
    return (facts.max_num_batched_tokens * line["per_token"] * facts.qkv_bytes_per_token
            + (seqs - 1) * line["per_sequence"] * facts.state_bytes_per_slot + copy)


def requests_that_fit(facts: ModelFacts, page_bytes: int, reserved_bytes: float = 0.0) -> float:
    """Requests of max_model_len tokens the engine holds with GDN pages of `page_bytes` (vLLM's
    hybrid allocator: attention blocks hold as many bytes as a GDN page, a request takes one
    state page per GDN layer, two with align-mode prefix caching), from the memory left after
    the weights, the table's share of the engine's memory for activations and graphs, and
    `reserved_bytes` more that the engine's memory profile holds back (the ring's prefill step)."""
    budget = facts.memory_bytes * (1 - tables()["rule"]["activation_share"]) - facts.weight_bytes - reserved_bytes
    if budget <= 0:
        return 0.0
    tokens_per_block = max(16, math.ceil(page_bytes / max(facts.kv_bytes_per_token, 1) / 16) * 16)
    block_bytes = tokens_per_block * facts.kv_bytes_per_token
    attention = facts.attention_layers * math.ceil(facts.max_model_len / tokens_per_block) * block_bytes
    gdn = facts.gdn_layers * (2 if facts.align else 1) * max(page_bytes, block_bytes)
    return budget / (attention + gdn)
