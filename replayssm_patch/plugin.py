"""`vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts
(front end, engine core, workers) before any model is built. Inert unless
VLLM_GDN_REPLAYSSM=1; invalid option values raise, naming the variable."""

from __future__ import annotations


def register() -> None:
    from . import options, patching

    opts = options.from_env()
    if opts.enabled:
        patching.apply(opts)
