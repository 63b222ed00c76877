"""The Qwen GDN layer with a replay ring: cache spec, page binding, backend and forward.

Registered with `QwenGatedDeltaNetAttention.register_oot`, so every Qwen GDN layer vLLM
builds is this class; Olmo and Kimi GDN layers are left alone. A layer whose config the
ring cannot serve (see ring_plan) behaves exactly like vLLM's class.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from math import prod

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as vllm_gdn
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from . import intercept, kernels, shadow
from .backend import ReplayGDNAttentionBackend, ReplayGDNAttentionMetadata
from .decisions import current_plan, layer_report
from .ring_plan import RingPlan


@dataclass
class RingBuffers:
    g: torch.Tensor  # [slots, HV, L] float32, cumulative log-decay
    d: torch.Tensor  # [slots, HV, L, V]
    k: torch.Tensor  # [slots, H, L, K]
    cursor: torch.Tensor  # [slots] int32: committed entries n | pending verify window << 8
    shadow: torch.Tensor | None = None  # exact-state copy for the shadow check (testing aid)


class ReplayQwenGDN(QwenGatedDeltaNetAttention):
    def __init__(self, config, vllm_config, prefix: str = "", *args, **kwargs):
        super().__init__(config, vllm_config, prefix, *args, **kwargs)
        self.ring_plan: RingPlan | None
        self.ring_plan, reasons = current_plan(vllm_config)
        self.replay_ring: RingBuffers | None = None
        if self.ring_plan is not None and (
            self.num_k_heads // self.tp_size != self.ring_plan.num_k_heads
            or self.num_v_heads // self.tp_size != self.ring_plan.num_v_heads
        ):
            self.ring_plan, reasons = None, ["layer head counts differ from the model config"]
        layer_report[prefix] = "ring" if self.ring_plan else "native: " + "; ".join(reasons)
        if self.ring_plan is not None and self.ring_plan.spec_tokens:
            # vLLM's fused MTP decode (CUDA) reads and writes 1+T state slots per request
            # itself; with the ring every speculative step must reach _forward_core.
            for flag in ("enable_fused_gdn_spec_decode", "enable_fused_gdn_decode"):
                if hasattr(self, flag):
                    setattr(self, flag, False)

    # -- cache spec and page binding ------------------------------------------------------
    # vLLM binds the layer's cache by assigning `kv_cache` (MambaBase.bind_kv_cache) and
    # releases it the same way (clear_layer_kv_caches, after the minimal cache its CUDA-graph
    # memory profile binds; again on shutdown). The ring's views point into those pages, so
    # they go with every assignment: kept, they held the released profiling cache alive,
    # memory vLLM had not accounted for (max_num_seqs pages of every GDN layer).
    @property
    def kv_cache(self):
        try:
            return self.__dict__["_bound_kv_cache"]
        except KeyError:  # not bound yet: as vLLM's class, which only annotates the attribute
            raise AttributeError("kv_cache") from None

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self.__dict__["_bound_kv_cache"] = value
        self.__dict__["replay_ring"] = None

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if self.ring_plan is None or spec is None:
            return spec
        extra = {}
        if self.ring_plan.spec_tokens:
            # One checkpoint slot per request instead of 1+T: the verify window lives in the
            # ring. Every layer this config builds is on the ring (the plan is per config).
            extra["num_speculative_blocks"] = 0
        return replace(spec, shapes=tuple(spec.shapes) + self.ring_plan.shapes,
                       dtypes=tuple(spec.dtypes) + self.ring_plan.dtypes, **extra)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)
        if self.ring_plan is None:
            return
        pages = kv_cache.squeeze(dim=(1, 2))
        offset = sum(prod(s) * t.element_size() for s, t in zip(self.get_state_shape(), self.kv_cache))
        views = []
        for shape, dtype in zip(self.ring_plan.shapes, self.ring_plan.dtypes):
            nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
            views.append(pages[:, offset:offset + nbytes].view(dtype).view(-1, *shape))
            offset += nbytes
        g, d, k = views
        self.replay_ring = RingBuffers(g=g, d=d, k=k, cursor=self._cursor_for(pages))
        if pages.is_cuda:
            kernels.compile_ahead(self.ring_state(), self.replay_ring, bool(self.ring_plan.spec_tokens))
        if shadow.poison_enabled():  # testing aid: garbage in every ring nobody started yet
            shadow.poison_rings(self.replay_ring)

    def _cursor_for(self, pages: torch.Tensor) -> torch.Tensor:
        """The slots' cursor words. A rebind that still fits (vLLM 0.34's extensible cache
        binds its capacity, captures the CUDA graphs, then rebinds fewer blocks at the same
        addresses) keeps a prefix of the same tensor, whose address those graphs hold; a larger
        or moved cache gets a new, empty one."""
        slots = pages.shape[0]
        cursor = self.__dict__.get("_ring_cursor")
        if cursor is None or cursor.device != pages.device or cursor.numel() < slots:
            cursor = torch.zeros(slots, dtype=torch.int32, device=pages.device)
            self.__dict__["_ring_cursor"] = cursor
        return cursor[:slots]

    def get_attn_backend(self):
        return ReplayGDNAttentionBackend if self.ring_plan is not None else super().get_attn_backend()

    # -- forward ----------------------------------------------------------------------------
    def ring_metadata(self) -> ReplayGDNAttentionMetadata | None:
        """This step's ring metadata, or None where vLLM's own path must run unchanged."""
        if self.replay_ring is None:
            return None
        md = get_forward_context().attn_metadata
        md = md.get(self.prefix) if isinstance(md, dict) else None
        if not isinstance(md, ReplayGDNAttentionMetadata) or md.ring_force_flush is None:
            return None
        return md

    def ring_state(self) -> torch.Tensor:
        """The checkpoint as [slot, HV, V, K] (h[v, k]), as the ring kernels index it."""
        return self.kv_cache[1]

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        md = self.ring_metadata()
        native = super()._forward_core
        if md is None:
            return native(mixed_qkv, b, a, core_attn_out)
        if mixed_qkv.is_cuda and intercept.speculative_only(md):
            return intercept.verify_step(self, md, mixed_qkv, b, a, core_attn_out, vllm_gdn)
        return intercept.run_with_ring(self, md, self.ring_state(),
                                       lambda: native(mixed_qkv, b, a, core_attn_out))


def cpu_state_view(layer) -> torch.Tensor:
    """vLLM's CPU GDN kernels read each head as [K][V]; as [V, K] that is the transpose."""
    return intercept._cpu_kv_view(layer).transpose(-1, -2)


def make_cpu_nonspec_wrapper(native):
    """Wrap vLLM's `_cpu_gdn_attention_nonspec(layer, md, mixed_qkv, b, a, core_attn_out)`."""

    def cpu_gdn_attention_nonspec(layer, attn_metadata_i, *args, **kw):
        md = layer.ring_metadata() if isinstance(layer, ReplayQwenGDN) else None
        if md is None:
            return native(layer, attn_metadata_i, *args, **kw)
        return intercept.run_with_ring(layer, md, cpu_state_view(layer),
                                       lambda: native(layer, attn_metadata_i, *args, **kw))

    return functools.update_wrapper(cpu_gdn_attention_nonspec, native)  # name, doc, __wrapped__ (signature)
