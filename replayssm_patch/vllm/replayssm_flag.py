"""Patch point: `EngineArgs.create_model_config`, so that vLLM's own `--use-replayssm`
(`LLM(use_replayssm=True)`) turns this package's ring on for models that build Qwen GDN layers.

vLLM's flag is Mamba2 ReplaySSM: its validator refuses every class that does not declare
`SupportsReplaySSM` (no Qwen class does), and where it passes, its machinery acts on every Mamba
layer (no speculative state blocks, backend and model-runner constraints). So for a model class
that builds `QwenGatedDeltaNetAttention` the flag never reaches vLLM: right after vLLM builds the
ModelConfig (the model class is known, `CacheConfig(use_replayssm=...)` not built yet), the flag
is taken off the EngineArgs, `replayssm_buffer_len` becomes the ring length, the patch applies in
this process and the config goes into the environment, which vLLM's engine-core and worker
processes start with (their plugin applies it there). Every other model keeps vLLM's behaviour:
the flag passes through untouched.

Installed in every process by the plugin, whatever the config; inert until the flag is given.
vLLM loads its general plugins in `EngineArgs.__post_init__`, before `create_engine_config`, in
the process that parses the arguments (the API server for `vllm serve`, the user's for `LLM`).
"""

from __future__ import annotations

import functools
import logging
import os


def make_wrapper(native):
    @functools.wraps(native)
    def create_model_config(self):
        model_config = native(self)
        if getattr(self, "use_replayssm", False):
            take_over(self, model_config)
        return model_config

    return create_model_config


def take_over(engine_args, model_config) -> bool:
    """Serve `engine_args.use_replayssm` with the ring if the model builds Qwen GDN layers (and
    vLLM does not serve ReplaySSM for its class itself); returns whether it did. Raises
    OptionError naming --replayssm-buffer-len for a length outside 1..64."""
    from .. import activation
    from ..config import declare_to_vllm, from_vllm_flag
    from ..state import STATE
    from .model_class import builds_qwen_gdn_layers

    if getattr(model_config, "supports_replayssm", False):
        return False  # vLLM's own ReplaySSM serves this class
    builds, _ = builds_qwen_gdn_layers(model_config)
    if not builds:
        return False
    arch = model_config.architecture
    config = from_vllm_flag(engine_args.replayssm_buffer_len)
    # this engine is being built now, with this config: not "too late" (activation._too_late)
    STATE.engine_started, STATE.engine_config = True, config
    report = activation.apply(config)
    if not report["applied"]:
        STATE.log_once(logging.WARNING, f"replayssm_patch: --use-replayssm for {arch} is left to vLLM: the ring "
                                         f"cannot apply here ({'; '.join(report['reasons'])})")
        return False
    engine_args.use_replayssm = False  # vLLM's validator and Mamba2 machinery never see it
    os.environ.update(config.to_env())  # vLLM's engine-core and worker processes start with a copy
    declare_to_vllm()
    STATE.log_once(logging.INFO, f"replayssm_patch: --use-replayssm turned the GDN ring on for {arch} (ring "
                                 f"length {config.ring_len} from --replayssm-buffer-len; vLLM's own Mamba2 "
                                 "ReplaySSM stays off for this model)")
    return True
