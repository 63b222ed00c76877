"""`vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts (front
end, engine core, workers) before any model is built. Inert unless VLLM_GDN_REPLAYSSM=1: only
then are the other variables read, and an invalid value raises, naming the variable. Whatever
the variables say, it routes vLLM's own `--use-replayssm` (`LLM(use_replayssm=True)`) to the
ring for Qwen GDN models (replayssm_patch.vllm.replayssm_flag): a wrapper that does nothing
until that flag is given."""

from __future__ import annotations


def register() -> None:
    from . import activation, config

    config.declare_to_vllm()
    activation.install_hooks()
    wanted = config.from_env()
    if wanted.enable:
        activation.apply(wanted)
    # after apply: the config this process's first engine is built with (a process vLLM spawns
    # starts without any, and its own apply is not "too late")
    activation.note_engine_start()
