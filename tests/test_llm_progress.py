"""``LLM.generate(use_tqdm=...)``: a progress bar as vLLM's (prompts done, token speeds), or none."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str):
    engine = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    yield engine
    engine.shutdown()


def test_progress_bar_counts_every_prompt_and_reports_speeds(llm: LLM, capsys) -> None:
    outputs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "3/3" in err
    assert "est. speed input:" in err and "output:" in err


def test_no_bar_when_disabled_and_a_custom_bar_factory_is_used(llm: LLM, capsys) -> None:
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""
    made = []

    def factory(**kwargs):
        from tqdm import tqdm
        bar = tqdm(**kwargs, disable=True)
        made.append(kwargs["total"])
        return bar

    llm.generate([[5, 6, 7], [1, 2]], SamplingParams(max_tokens=2), use_tqdm=factory)
    assert made == [2]
