"""lm-evaluation-harness against the real stack: `local-completions` loglikelihood on a local task.

A multiple-choice task (a task YAML and a jsonl dataset written into tmp_path; no hub access) runs through
`lm_eval.simple_evaluate` with the `local-completions` model type pointed at `redserve api`, as users run
it against vLLM. lm_eval tokenizes with the model dir's tokenizer and sends `echo=true, logprobs=1,
max_tokens=1` requests of token ids, then sums `token_logprobs[ctxlen:-1]` per choice. Each choice's sum
(and lm_eval's is-greedy flag) must equal transformers' on the same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import hf_model

pytest.importorskip("lm_eval", reason="lm_eval is a dev extra")

TOL = 1e-3  # a sum of up to a dozen fp32 log-probs
TASK = "redserve_tiny_mc"
DOCS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
    {"question": "import os\nprint(os.path.", "choices": ["join('a', 'b'))", "exists(path))", "sep)"], "answer": 1},
    {"question": "for i in range(10):", "choices": ["\n    print(i)", "\n    pass", " continue"], "answer": 2},
    {"question": "class Config:", "choices": ["\n    name = 'x'", "\n    def __init__(self):"], "answer": 0},
]


def write_task(directory) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
target_delimiter: ""
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
""")


def hf_loglikelihood(model_dir: str, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """lm_eval's split (encode the whole, cut at the context's length) scored by transformers."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_len = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[context_len - 1:-1]
    wanted = torch.tensor(whole[context_len:])
    chosen = logprobs.gather(1, wanted.unsqueeze(1)).squeeze(1)
    return chosen.sum().item(), bool((logprobs.argmax(dim=-1) == wanted).all())


def test_local_completions_loglikelihood_matches_hf(api_stack, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("OPENAI_API_KEY", api_stack.API_KEY)
    write_task(tmp_path)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    results = simple_evaluate(
        model="local-completions",
        model_args={"model": api_stack.model_dir, "base_url": f"{api_stack.base_url}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": api_stack.model_dir,
                    "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
        bootstrap_iters=0, random_seed=0)

    tokenizer = AutoTokenizer.from_pretrained(api_stack.model_dir)
    samples = results["samples"][TASK]
    assert len(samples) == len(DOCS)
    for sample in samples:
        requests = [args for args in sample["arguments"]]
        assert len(requests) == len(sample["doc"]["choices"])
        for (context, continuation), response in zip(requests, sample["resps"], strict=True):
            got_logprob, got_greedy = response[0]
            want_logprob, want_greedy = hf_loglikelihood(api_stack.model_dir, tokenizer, context, continuation)
            assert abs(got_logprob - want_logprob) < TOL, (context, continuation, got_logprob, want_logprob)
            assert got_greedy == want_greedy
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0
