"""`vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts
(front end, engine core, workers) before any model is built. Inert unless
VLLM_GDN_REPLAYSSM=1: only then are the other variables read, and an invalid value raises,
naming the variable."""

from __future__ import annotations


def register() -> None:
    from . import options, patching

    options.declare_to_vllm()
    patching.note_engine_start()
    if options.enabled_in_env():
        patching.apply(options.from_env())
