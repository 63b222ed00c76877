"""What a new user meets first: the plugin with other variables set, vLLM's environment check,
patch() called too late, doctor's answers and errors, model classes the patch must size or
leave alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from replayssm_patch import config
from replayssm_patch.vllm import model_class as model_hooks
from replayssm_patch.testing import cache_dir

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")


def test_plugin_is_inert_when_disabled_whatever_the_other_variables_say(monkeypatch, clean_patch_state):
    from replayssm_patch import plugin

    monkeypatch.delenv("VLLM_GDN_REPLAYSSM", raising=False)
    monkeypatch.setenv("VLLM_GDN_REPLAYSSM_RING", "abc")
    plugin.register()  # no error: the patch is off
    assert clean_patch_state.applied is False
    monkeypatch.setenv("VLLM_GDN_REPLAYSSM", "1")
    with pytest.raises(config.OptionError, match="VLLM_GDN_REPLAYSSM_RING='abc'"):
        plugin.register()


def test_vllm_knows_our_variables(monkeypatch, clean_patch_state):
    """vLLM warns about (or with fail_on_environ_validation refuses) unknown VLLM_* variables."""
    from vllm.platforms import current_platform

    from replayssm_patch import plugin

    for name in config.ReplayConfig().to_env():
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("VLLM_GDN_REPLAYSSM_RING", "16")
    monkeypatch.setenv("VLLM_GDN_REPLAYSSM_RING_DTYPE", "auto")
    plugin.register()
    current_platform.validate_environ(hard_fail=True)  # raises on an unknown VLLM_* variable
    monkeypatch.setenv("VLLM_GDN_REPLAYSSM_RNG", "16")  # a typo is still reported
    with pytest.raises(ValueError, match="VLLM_GDN_REPLAYSSM_RNG"):
        current_platform.validate_environ(hard_fail=True)


def test_plugin_in_a_fresh_engine_process_does_not_say_too_late(monkeypatch, clean_patch_state, caplog):
    """A process vLLM spawns (engine core, worker) runs the plugin before anything else: its
    apply is the first, so no 'too late' warning; a later patch() with other options still gets one."""
    import replayssm_patch
    from replayssm_patch import plugin

    for name in config.ReplayConfig().to_env():  # recorded, so what patch() sets is undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_GDN_REPLAYSSM", "1")
    plugin.register()
    report = replayssm_patch.status()
    assert report["enabled"] and report["warnings"] == [], report
    assert not any("after vLLM created an engine" in r.getMessage() for r in caplog.records)
    late = replayssm_patch.patch(ring_len=8)["warnings"]
    assert any("with other replayssm options" in w for w in late), late


def test_patch_after_an_engine_was_created_says_it_is_too_late(clean_patch_state, caplog):
    import replayssm_patch

    from replayssm_patch import activation

    activation.note_engine_start()  # what the plugin does when vLLM creates its first engine
    report = replayssm_patch.patch()
    assert any("after vLLM created an engine" in w and "with the patch off" in w for w in report["warnings"])
    assert any("call patch() before creating the LLM" in r.getMessage() for r in caplog.records)
    assert replayssm_patch.patch()["warnings"] == report["warnings"]  # same options: reported once
    replayssm_patch.unpatch()
    assert replayssm_patch.status()["warnings"] == []


@pytest.mark.vllm
def test_patch_after_a_real_engine_reports_it_in_process(tmp_path):
    """The same with a real vLLM engine (CPU build, in process): it stays native, and says why."""
    from replayssm_patch.testing.tiny_models import build_tiny_model

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5"))
    script = textwrap.dedent(f"""
        import json
        if __name__ == "__main__":
            from vllm import LLM
            import replayssm_patch
            llm = LLM({model!r}, load_format="safetensors", enforce_eager=True, max_model_len=256,
                      skip_tokenizer_init=True, max_num_seqs=2)
            report = replayssm_patch.patch()
            print("REPORT " + json.dumps({{"warnings": report["warnings"], "layers": report["layers"]}}))
    """)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.split("REPORT ", 1)[1])
    assert report["layers"] == {} and any("after vLLM created an engine" in w for w in report["warnings"])


# -- doctor ------------------------------------------------------------------------------------
def _doctor(*args, env=None):
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "replayssm_patch", "doctor", *args], capture_output=True,
                       text=True, timeout=600, env=e)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.slow
def test_doctor_on_a_missing_path_says_so_in_one_line(tmp_path):
    rc, out, err = _doctor(str(tmp_path / "no-such-model"))
    assert rc == 2 and "is not a directory" in out
    assert "Traceback" not in out + err


@pytest.mark.slow
def test_doctor_never_downloads_an_uncached_hub_id(tmp_path):
    """A Hub id not in the local cache: answered from the cache alone (no retries against the
    Hub), with vLLM's whole error."""
    import time

    start = time.monotonic()
    rc, out, err = _doctor("nobody-here/no-such-model-xyz", env={"HF_HOME": str(tmp_path)})
    assert rc == 2 and "cannot read the configuration of 'nobody-here/no-such-model-xyz'" in out, out + err
    assert time.monotonic() - start < 60 and "Traceback" not in out + err


def test_help_and_a_bare_call():
    p = subprocess.run([sys.executable, "-m", "replayssm_patch", "--help"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "doctor" in p.stdout and "Exit status" in p.stdout
    p = subprocess.run([sys.executable, "-m", "replayssm_patch"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "usage:" in p.stderr


@pytest.mark.parametrize("value", ["0", "99", "x"])
def test_doctor_rejects_a_bad_ring_length_as_a_usage_error(value):
    rc, out, err = _doctor("--ring-len", value)
    assert rc == 2 and "--ring-len" in err and "Traceback" not in out + err


@pytest.mark.slow
def test_doctor_on_a_model_without_gdn_layers(tmp_path):
    """A Llama config: no GDN layers, native, said plainly."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=256,
               intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = _doctor(str(tmp_path))
    assert rc == 1 and "0 GDN layers" in out and "no Gated DeltaNet" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("arch,builds", [
    ("Qwen3_5ForCausalLM", True), ("Qwen3_5ForConditionalGeneration", True),
    ("Qwen3_5MoeForConditionalGeneration", True), ("Qwen3NextForCausalLM", True),
    ("OlmoHybridForCausalLM", False), ("KimiLinearForCausalLM", False), ("LlamaForCausalLM", False),
])
def test_layer_class_check_follows_what_the_model_builds(arch, builds, monkeypatch):
    """doctor asks whether the model builds vLLM's Qwen GDN layer class, which the patch replaces."""
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(arch)
    if cls is None:
        pytest.skip(f"{arch} is not in this vLLM build")
    monkeypatch.setattr(model_hooks, "_model_class", lambda cfg: cls)
    ok, reason = model_hooks.builds_qwen_gdn_layers(None)
    assert ok is builds, reason
    assert builds or "QwenGatedDeltaNetAttention" in reason


# -- page-size hooks -----------------------------------------------------------------------------
def test_page_hook_finds_the_gdn_spec_by_its_shapes_not_its_mamba_type(monkeypatch):
    from replayssm_patch.state import PatchState

    state = PatchState()
    """Qwen4Exp builds its GDN MambaSpec without a mamba_type (vLLM's default MAMBA2) beside
    another spec: the ring is added to the spec holding the GDN state, and only to it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    gdn = MambaSpec(block_size=-1, shapes=((3, 768), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32))
    other = MambaSpec(block_size=-1, shapes=((3, 64),), dtypes=(torch.bfloat16,))

    class Qwen4ExpLike:
        @classmethod
        def get_mamba_specs_from_config(cls, vllm_config):
            return (gdn, other)

    monkeypatch.setattr(model_hooks, "_model_class", lambda cfg: Qwen4ExpLike)
    ring = (((4, 16), (4, 16, 128), (2, 16, 128)), (torch.float32,) * 3, (4, 128, 128))
    try:
        assert model_hooks.ensure(SimpleNamespace(), lambda cfg: ring, state) == (True, "")
        specs = Qwen4ExpLike.get_mamba_specs_from_config(SimpleNamespace())
    finally:
        while state.undo:
            state.undo.pop()()
    assert specs[0].shapes == gdn.shapes + ring[0] and specs[0].dtypes == gdn.dtypes + ring[1]
    assert specs[1] == other
    assert Qwen4ExpLike.get_mamba_specs_from_config(SimpleNamespace()) == (gdn, other)  # removed again


def test_builder_recomputes_prefill_slots_per_kv_cache_group(monkeypatch):
    """vLLM's V2 runner builds one GDN group's metadata and calls update_block_table for the
    others (re-gathered state indices): the ring's prefill slot lists must be this group's, the
    batch-level flags shared."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from replayssm_patch.vllm.gdn_backend import ReplayGDNAttentionMetadata, ReplayGDNAttentionMetadataBuilder

    def regather(self, metadata, blk_table, slot_mapping):  # what vLLM's does, for non-spec batches
        from dataclasses import replace

        return replace(metadata, non_spec_state_indices_tensor=blk_table[:, 0])

    monkeypatch.setattr(GDNAttentionMetadataBuilder, "update_block_table", regather)
    names = {f for f in ReplayGDNAttentionMetadata.__dataclass_fields__}
    base = {n: None for n in names}
    empty = torch.tensor([0, 0, 1, 0], dtype=torch.int8)  # row 2 starts a new block
    group0 = ReplayGDNAttentionMetadata(**dict(
        base, num_prefills=2, num_decodes=2, num_decode_tokens=2, num_prefill_tokens=9, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=11, non_spec_state_indices_tensor=torch.tensor([1, 2, 3, 4]),
        has_initial_state=torch.tensor([True, True, True, True]), ring_start_empty=empty,
        ring_force_flush=torch.zeros(4, dtype=torch.int8), ring_prefill_slots=torch.tensor([3, 4]),
        ring_prefill_flush_slots=torch.tensor([0, 4]), ring_decode=True))
    builder = object.__new__(ReplayGDNAttentionMetadataBuilder)
    other = builder.update_block_table(group0, torch.tensor([[11], [12], [13], [14]]), None)
    assert other.ring_prefill_slots.tolist() == [13, 14]
    assert other.ring_prefill_flush_slots.tolist() == [0, 14]  # row 2's ring is stale: not flushed
    assert other.ring_start_empty is empty and other.ring_decode
    decodes_only = builder.update_block_table(
        ReplayGDNAttentionMetadata(**{**group0.__dict__, "num_prefills": 0}), torch.tensor([[21], [22]]), None)
    assert decodes_only.ring_prefill_slots is None and decodes_only.ring_prefill_flush_slots is None


def test_prefill_checkpoint_blocks_empty_their_rings():
    """vLLM >= 0.33's FlashInfer GDN prefill writes align-mode checkpoints into blocks inside a
    chunk (`md.checkpoint.state_indices`; 0, the null block, for a row without one): the builder
    adds them to the prefill slots whose rings empty after the core, so a cursor the block's
    earlier owner left is never replayed onto the fresh checkpoint."""
    from replayssm_patch.ops.materialize_reference import ring_reset_reference
    from replayssm_patch.vllm.gdn_backend import ReplayGDNAttentionMetadataBuilder

    md = SimpleNamespace(num_prefills=2, num_decodes=1, non_spec_state_indices_tensor=torch.tensor([1, 2, 3]),
                         has_initial_state=torch.tensor([True, True, False]),
                         checkpoint=SimpleNamespace(state_indices=torch.tensor([0, 7], dtype=torch.int32)))
    out = ReplayGDNAttentionMetadataBuilder._prefill_slots(md, torch.zeros(3, dtype=torch.int8))
    assert out["ring_prefill_slots"].tolist() == [2, 3, 0, 7]
    assert out["ring_prefill_flush_slots"].tolist() == [2, 0]  # slot 3 starts without a state: nothing to flush
    cursor = torch.tensor([5, 1, 2, 3, 4, 4, 4, 6, 1], dtype=torch.int32)
    ring_reset_reference(cursor, out["ring_prefill_slots"])  # what the layer runs after the core
    assert cursor.tolist() == [5, 1, 0, 0, 4, 4, 4, 0, 1]  # block 7 emptied, the null block untouched
    del md.checkpoint  # vLLM < 0.33, or a prefill that writes none: the prefill slots alone
    assert ReplayGDNAttentionMetadataBuilder._prefill_slots(md, torch.zeros(3, dtype=torch.int8))[
        "ring_prefill_slots"].tolist() == [2, 3]


def test_metrics_plan_info_says_ring_or_native_and_replaces_an_earlier_engines(clean_patch_state):
    """/metrics (vllm/metrics_info.py): the plan's labels, one series per engine, on vLLM's gauge
    class; a second engine in the same process replaces the first one's gauge."""
    import types

    import torch
    from prometheus_client import REGISTRY, Gauge

    from replayssm_patch.plan import OPT_IN, Plan, Reason, RingGeometry
    from replayssm_patch.vllm import metrics_info

    ring = Plan("cuda", RingGeometry(16, 32, 128, 128, 16, torch.bfloat16, torch.float32), spec_tokens=3)
    stat_logger = types.SimpleNamespace(_gauge_cls=Gauge, engine_indexes=[0, 1])
    metrics_info.record(stat_logger, ring)
    labels = dict(decision="ring", steps="MTP T=3", ring_len="16", ring_dtype="bfloat16", state_dtype="float32",
                  verify_kernel="triton", reasons="")
    for engine in ("0", "1"):
        assert REGISTRY.get_sample_value(metrics_info.METRIC, dict(labels, engine=engine)) == 1.0
    native = Plan("cuda", reasons=(Reason(OPT_IN, "allow_mtp='native'"),))
    metrics_info.record(types.SimpleNamespace(_gauge_cls=Gauge, engine_indexes=[0]), native)
    assert REGISTRY.get_sample_value(metrics_info.METRIC, dict(labels, engine="0")) is None
    got = metrics_info.plan_labels(native)
    assert got["decision"] == "native" and "allow_mtp='native'" in got["reasons"] and got["ring_len"] == ""
    assert REGISTRY.get_sample_value(metrics_info.METRIC, dict(got, engine="0")) == 1.0
    REGISTRY.unregister(clean_patch_state.plan_gauge)


def test_metrics_plan_info_failing_never_stops_the_engine(clean_patch_state, monkeypatch, caplog):
    """A report that cannot be drawn logs a warning; vLLM's own info metric is still recorded."""
    import types

    from replayssm_patch.vllm import metrics_info

    calls = []
    wrapped = metrics_info.make_wrapper(lambda self, type, config_obj: calls.append(type))

    def broken(vllm_config, config):
        raise ValueError("no plan here")

    monkeypatch.setattr(metrics_info, "front_end_plan", broken)
    with caplog.at_level("WARNING"):
        wrapped(types.SimpleNamespace(vllm_config=None), "cache_config", None)
    assert calls == ["cache_config"]
    assert "/metrics has no plan_info (ValueError: no plan here)" in caplog.text
    assert clean_patch_state.plan_gauge is None


def _eventually(check, seconds=10.0) -> bool:
    """Whether `check()` holds within `seconds` (a background thread's write)."""
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_worker_counters_reach_metrics_from_live_workers_only(clean_patch_state, tmp_path):
    """/metrics's ring counters (worker_counters): what each live worker last wrote, per rank and
    counter, worst cases ("_max_") left out; a dead worker's file, a stray file and a native plan
    give nothing."""
    import types

    from prometheus_client import REGISTRY, Gauge

    from replayssm_patch import worker_counters
    from replayssm_patch.plan import OPT_IN, Plan, Reason, RingGeometry
    from replayssm_patch.vllm import metrics_info

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"{dead.stdout.strip()}.json").write_text(json.dumps(
        {"pid": int(dead.stdout), "rank": 1, "counters": {"decode_rows": 99}}))
    (tmp_path / "stray.json").write_text("{not json")
    clean_patch_state.counters_dir = str(tmp_path)
    clean_patch_state.stats.update(decode_rows=12, flushes=3, shadow_max_rel_err_x1e6=7)
    before = set(threading.enumerate())
    clean_patch_state.publish_stats_in_background(0.05)
    clean_patch_state.publish_stats_in_background(0.05)  # still one thread: one per process
    assert [t.name for t in set(threading.enumerate()) - before] == ["replayssm-counters"]
    ring = Plan("cuda", RingGeometry(16, 32, 128, 128, 16, torch.bfloat16, torch.float32))
    metrics_info.record(types.SimpleNamespace(_gauge_cls=Gauge, engine_indexes=[0]), ring)
    name = worker_counters.METRIC + "_total"
    me = dict(rank="0", pid=str(os.getpid()))
    assert _eventually(lambda: REGISTRY.get_sample_value(name, dict(me, counter="decode_rows")) == 12)
    assert REGISTRY.get_sample_value(name, dict(me, counter="flushes")) == 3
    assert REGISTRY.get_sample_value(name, dict(me, counter="shadow_max_rel_err_x1e6")) is None
    assert REGISTRY.get_sample_value(name, dict(rank="1", pid=dead.stdout.strip(), counter="decode_rows")) is None
    clean_patch_state.stats["decode_rows"] += 5  # no step follows: the thread alone writes it
    assert _eventually(lambda: REGISTRY.get_sample_value(name, dict(me, counter="decode_rows")) == 17)
    native = Plan("cuda", reasons=(Reason(OPT_IN, "allow_mtp='native'"),))
    metrics_info.record(types.SimpleNamespace(_gauge_cls=Gauge, engine_indexes=[0]), native)
    assert clean_patch_state.counters_collector is None
    assert REGISTRY.get_sample_value(name, dict(me, counter="decode_rows")) is None
    REGISTRY.unregister(clean_patch_state.plan_gauge)


def test_worker_counters_directory_is_shared_with_started_processes(clean_patch_state, tmp_path, caplog):
    """The first patched process makes the directory and names it for the processes it starts; they
    use it; a name that does not exist on this host gets a new one; an unwritable one is given up."""
    from replayssm_patch import worker_counters

    env: dict[str, str] = {}
    made = worker_counters.shared_dir(env)
    assert os.path.isdir(made) and env == {worker_counters.ENV: made}
    assert worker_counters.shared_dir(dict(env)) == made
    other = {worker_counters.ENV: str(tmp_path / "on-another-host")}
    assert worker_counters.shared_dir(other) not in ("", made, str(tmp_path / "on-another-host"))
    clean_patch_state.counters_dir = str(tmp_path / "gone")
    clean_patch_state.stats["decode_rows"] = 1
    with caplog.at_level("WARNING"):
        clean_patch_state.publish_stats_in_background(0.05)
        assert _eventually(lambda: clean_patch_state.counters_dir is None)
    assert "counters stay out of /metrics" in caplog.text
