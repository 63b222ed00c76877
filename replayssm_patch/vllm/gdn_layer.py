"""Patch point: the Qwen GDN layer with a replay ring (registered with
`QwenGatedDeltaNetAttention.register_oot`, so every Qwen GDN layer vLLM builds is this class;
Olmo and Kimi GDN layers are left alone).

The layer takes its plan (replayssm_patch.plan) from vLLM's config and the process's
ReplayConfig as vLLM builds it; a layer the plan keeps native behaves exactly like vLLM's class.
A ring layer adds the ring to its cache spec (which carries the plan to the metadata builder) and
to its pages, and runs vLLM's own GDN core inside a ring call, so that vLLM's recurrence kernels,
replaced by the wrappers of this package, find the ring.
"""

from __future__ import annotations

import logging
from functools import partial
from math import prod

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as vllm_gdn
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from ..plan import Plan, device_memory, make_plan
from ..ring import shadow
from ..ring.call import cpu_kv_view, run_with_ring
from ..ring.runtime import RingBuffers, ops_for
from ..state import STATE, PatchRefused
from .. import versions
from . import (align_copy_funcs, flashinfer_pool_prefill, fused_decode_flags, model_class, prefill_groups,
               prefill_profile, spec_verify_step)
from .gdn_backend import ReplayGDNAttentionBackend, ReplayGDNAttentionMetadata, ring_spec, state_offsets


def plan_for(vllm_config) -> Plan:
    """The plan of this process's config for `vllm_config`, logged once; the served model class
    gets its page-size hooks with the first ring plan."""
    plan = make_plan(vllm_config, STATE.config, device_memory())
    if plan.serves:
        ok, why = model_class.ensure(vllm_config, _ring_pages, STATE)
        if ok and plan.spec_tokens and getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "align":
            ok, why = align_copy_funcs.ensure(model_class.served_class(vllm_config), STATE)
        if not ok:
            from ..plan import UNSUPPORTED, Reason

            plan = Plan(plan.platform, spec_tokens=plan.spec_tokens, reasons=(Reason(UNSUPPORTED, why),))
    arch = getattr(vllm_config.model_config, "architecture", "model")
    msg = plan.describe(arch)
    if not plan.serves and not plan.by_choice and STATE.config.strict and STATE.config.enable:
        raise PatchRefused(msg)
    STATE.log_once(logging.WARNING if not plan.serves and not plan.by_choice else logging.INFO, msg)
    return plan


def _ring_pages(vllm_config):
    """(shapes, dtypes, GDN state shape) the ring adds to the page for `vllm_config`, or None."""
    g = make_plan(vllm_config, STATE.config, device_memory()).geometry
    return None if g is None else (g.shapes, g.dtypes, g.gdn_state_shape)


class ReplayQwenGDN(QwenGatedDeltaNetAttention):
    def __init__(self, config, vllm_config, prefix: str = "", *args, **kwargs):
        super().__init__(config, vllm_config, prefix, *args, **kwargs)
        plan = plan_for(vllm_config)
        g = plan.geometry
        if g is not None and (self.num_k_heads // self.tp_size, self.num_v_heads // self.tp_size) != \
                (g.num_k_heads, g.num_v_heads):
            from ..plan import UNSUPPORTED, Reason

            plan = Plan(plan.platform, reasons=(Reason(UNSUPPORTED, "layer head counts differ from the model config"),))
        self.ring_plan: Plan = plan
        self.ring_cache_config = vllm_config.cache_config  # read at binding (extensible caches)
        self.replay_ring: RingBuffers | None = None
        self.ring_ops = ops_for(plan.platform, STATE.stats) if plan.serves else None
        # the most sequences one prefill step may hold, for the step the memory profile sees
        self.ring_max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        STATE.layers[prefix] = "ring" if plan.serves else "native: " + "; ".join(map(str, plan.reasons))
        if plan.serves and plan.spec_tokens:
            fused_decode_flags.disable(self)
        if self._groups_prefill():
            self.chunk_gated_delta_rule = prefill_groups.GroupedPrefillOp(self.chunk_gated_delta_rule,
                                                                          self._step_prefill_groups)
        elif self._pool_prefill():
            self.chunk_gated_delta_rule = flashinfer_pool_prefill.PoolPrefillOp(
                self.chunk_gated_delta_rule, self._step_prefill_groups, versions.capabilities().fi_prefill_exps_gate)

    def _groups_prefill(self) -> bool:
        """Whether this layer runs its prefill op per group (prefill_groups): on the ring, on CUDA,
        with the Triton (FLA) prefill op, where vLLM's builder draws the chunk metadata the groups
        are drawn beside."""
        caps = versions.capabilities()
        return (self.ring_plan.serves and self.ring_plan.platform == "cuda" and caps is not None
                and caps.gdn_chunk_metadata and getattr(self, "gdn_prefill_backend", None) == "triton")

    def _pool_prefill(self) -> bool:
        """Whether this layer runs FlashInfer's prefill on its state pool in place
        (flashinfer_pool_prefill): on the ring, with vLLM's FlashInfer prefill op, prefix caching
        off, where a GPU run validated it."""
        align = getattr(self.ring_cache_config, "mamba_cache_mode", "none") == "align"
        return self.ring_plan.serves and flashinfer_pool_prefill.applies(
            self.ring_plan.platform, getattr(self, "gdn_prefill_backend", None), versions.installed_base_version(),
            align)

    def _step_prefill_groups(self):
        """This step's prefill groups from the ring's metadata with the layer's state pool, or None."""
        md = self.ring_metadata()
        return None if md is None or md.ring_prefill_groups is None else (md.ring_prefill_groups, self.kv_cache[1])

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
        if not self.ring_plan.serves or spec is None:
            return spec
        return ring_spec(spec, self.ring_plan)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)
        if not self.ring_plan.serves:
            return
        g = self.ring_plan.geometry
        pages = kv_cache.squeeze(dim=(1, 2))
        # The ring's tensors follow vLLM's states in the page, packed as vLLM packs those
        # (MambaBase.bind_kv_cache) and as the spec's page size counts every one of them
        # (MambaSpec.state_content_size_bytes): each state's bytes rounded up to the layer's
        # state_alignment (vLLM >= 0.34; without the attribute, none).
        native = list(zip(self.get_state_shape(), self.get_state_dtype()))
        states = native + list(zip(g.shapes, g.dtypes))
        sizes = [prod(shape) * dtype.itemsize for shape, dtype in states]
        starts = state_offsets(sizes, getattr(self, "state_alignment", 1))
        views = [pages[:, start:start + size].view(dtype).view(-1, *shape)
                 for start, size, (shape, dtype) in list(zip(starts, sizes, states))[len(native):]]
        cursor, rebound = self._cursor_for(pages)
        if rebound:  # shows in the counters that a rebind happened and kept the cursor
            STATE.stats["cursor_rebinds"] += 1
        buffers = RingBuffers(*views, cursor=cursor)
        config = STATE.config
        if config.shadow and not pages.is_cuda:
            # testing aid: exact states beside the ring, checked by vLLM's CPU decode (so CPU
            # only; on CUDA a first bind of an extensible cache is mostly unmapped memory)
            buffers.shadow = cpu_kv_view(self).clone()
        if config.poison and (rebound or not self._extensible_cache()):
            # testing aid: garbage in every ring nobody started yet. vLLM >= 0.34 first binds an
            # extensible cache over its whole reserved address range, of which only the first
            # blocks have memory behind them (warmup commits more as it goes): its rings are
            # poisoned at the rebind over the committed blocks, after CUDA-graph capture.
            shadow.poison_rings(buffers, STATE.stats)
        self.replay_ring = buffers
        self.ring_ops.compile_ahead(self.ring_state(), buffers, bool(self.ring_plan.spec_tokens))

    def _extensible_cache(self) -> bool:
        """vLLM binds an extensible KV cache (vLLM >= 0.34 on CUDA, unless turned off; vLLM's
        workers turn it off in this same config where the device cannot map memory on demand)."""
        return bool(getattr(self.ring_cache_config, "enable_extensible_kv_cache", False))

    def _cursor_for(self, pages: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The slots' cursor words, and whether they are a rebind's (kept from an earlier bind).
        A rebind that still fits (vLLM 0.34's extensible cache binds its capacity, captures the
        CUDA graphs, then rebinds fewer blocks at the same addresses) keeps a prefix of the same
        tensor, whose address those graphs hold, and its contents; a larger or moved cache gets
        a new, empty one."""
        slots = pages.shape[0]
        cursor = self.__dict__.get("_ring_cursor")
        if cursor is not None and cursor.device == pages.device and cursor.numel() >= slots:
            return cursor[:slots], True
        cursor = torch.zeros(slots, dtype=torch.int32, device=pages.device)
        self.__dict__["_ring_cursor"] = cursor
        return cursor, False

    def get_attn_backend(self):
        return ReplayGDNAttentionBackend if self.ring_plan.serves else super().get_attn_backend()

    # -- memory profile -----------------------------------------------------------------------
    def _warmup_prefill_kernels(self, qkv_or_qkvz: torch.Tensor, v_dim: int) -> None:
        """vLLM's warmup in the profile forward, then, once, on CUDA, a whole
        prefill step of the profile's tokens, so that the KV cache is sized without its memory
        (prefill_profile)."""
        first = not getattr(self, "_prefill_kernels_warmed_up", False)
        super()._warmup_prefill_kernels(qkv_or_qkvz, v_dim)
        if not (first and self.ring_plan.serves and self.ring_plan.platform == "cuda"):
            return
        backend = getattr(self, "gdn_prefill_backend", "triton")
        if backend not in ("triton", "flashinfer"):  # the others' ops take metadata built per step
            STATE.log_once(logging.WARNING, f"replayssm_patch: vLLM's memory profile leaves out the GDN prefill "
                                            f"step's temporaries with the {backend} prefill backend")
            return
        qkv = qkv_or_qkvz[:, :qkv_or_qkvz.shape[-1] - v_dim]
        tokens, seqs = qkv.shape[0], prefill_profile.profile_seqs(qkv.shape[0], self.ring_max_num_seqs)
        # (the profile's peak statistics are vLLM's: read, never reset, here)
        peak_before = torch.cuda.max_memory_allocated()
        op = self.chunk_gated_delta_rule
        grouped = isinstance(op, prefill_groups.GroupedPrefillOp)
        on_pool = isinstance(op, flashinfer_pool_prefill.PoolPrefillOp)
        if grouped:
            op = op.op
        elif on_pool:
            op = partial(flashinfer_pool_prefill.run, exps_gate=op.exps_gate)
        try:
            prefill_profile.prefill_step(op, qkv, (self.num_k_heads // self.tp_size, self.num_v_heads // self.tp_size),
                                         tuple(self.get_state_shape()[1]), self.get_state_dtype()[1], seqs,
                                         prefill_groups.fla_chunk_size() if grouped else None,
                                         spec_decode=bool(self.ring_plan.spec_tokens), on_pool=on_pool)
        except torch.OutOfMemoryError:
            raise  # the budget cannot hold such a step: serving it would fail the same way
        except Exception as e:  # the op refused the step's shapes: the engine starts as vLLM would
            STATE.log_once(logging.WARNING, f"replayssm_patch: vLLM's memory profile leaves out the GDN prefill "
                                            f"step's temporaries: the {backend} prefill op failed on it "
                                            f"({type(e).__name__}: {e})")
            return
        finally:
            torch.cuda.empty_cache()
        raised = (torch.cuda.max_memory_allocated() - peak_before) / (1 << 30)
        how = "per group of at most {} chunks of {} sequences".format(
            prefill_groups.GROUP_CHUNKS, prefill_groups.GROUP_SEQS) if grouped else \
            "on the state pool in place" if on_pool else "in one call"
        STATE.log_once(logging.INFO, f"replayssm_patch: vLLM's memory profile includes a GDN prefill step of {tokens} "
                                     f"tokens over {seqs} sequences ({backend} prefill, {how}), which vLLM's own "
                                     f"profile leaves out: it raised the profile's peak by {raised:.2f} GiB, which "
                                     "the KV cache gives up",
                       key="prefill profile step")  # the first layer's: the others' steps fit under its peak

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
        if mixed_qkv.is_cuda and spec_verify_step.applies(md):
            return spec_verify_step.verify_step(self, md, mixed_qkv, b, a, core_attn_out, vllm_gdn)
        return run_with_ring(self, md, self.ring_state(), lambda: native(mixed_qkv, b, a, core_attn_out))
