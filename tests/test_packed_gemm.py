"""The oneDNN-packed LM head (`worker.layers.packed_gemm`) gives F.linear's logits, follows reloads and ties,
and steps aside where it cannot serve (packing off, a dtype oneDNN does not compute natively)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers import packed_gemm
from worker.layers.linear import ParallelLMHead

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _head(vocab: int, hidden: int, dtype=torch.float32) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, dtype)
    head.load_shard(head.weight, torch.randn(vocab, hidden).to(dtype))
    return head


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 257])
@pytest.mark.parametrize(("vocab", "hidden"), [(8192, 512), (1000, 64), (37, 24)])
def test_packed_logits_equal_f_linear(rows: int, vocab: int, hidden: int) -> None:
    head = _head(vocab, hidden)
    x = torch.randn(rows, hidden)
    with torch.inference_mode():
        got = head.compute_logits(x)
    assert head._packed is not None  # made at the first call (used from MIN_ROWS rows)
    torch.testing.assert_close(got, F.linear(x, head.weight), rtol=1e-5, atol=1e-4)


def test_reloading_the_weight_repacks() -> None:
    head = _head(300, 32)
    x = torch.randn(16, 32)
    with torch.inference_mode():
        head.compute_logits(x)
        head.load_shard(head.weight, torch.randn(300, 32))
        torch.testing.assert_close(head.compute_logits(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-4)
        tied = torch.nn.Parameter(torch.randn(300, 32), requires_grad=False)
        head.weight = tied  # as model_loader ties the head to the embedding
        torch.testing.assert_close(head.compute_logits(x), F.linear(x, tied), rtol=1e-5, atol=1e-4)


def test_packing_off_by_env_uses_f_linear(monkeypatch) -> None:
    monkeypatch.setenv("REDSERVE_NO_KERNELS", "paged_attention,packed_gemm")
    head = _head(300, 32)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        torch.testing.assert_close(head.compute_logits(x), F.linear(x, head.weight))
    assert head._packed is None


def test_bfloat16_packs_only_where_onednn_computes_it() -> None:
    head = _head(300, 32, torch.bfloat16)
    x = torch.randn(16, 32).bfloat16()
    with torch.inference_mode():
        got = head.compute_logits(x)
    assert (head._packed is not None) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.testing.assert_close(got, F.linear(x, head.weight), rtol=2e-2, atol=2e-2)


def test_not_packed_off_the_cpu_or_in_float16() -> None:
    assert packed_gemm.pack_for_gemm(torch.randn(8, 4).half()) is None
    assert packed_gemm.pack_for_gemm(torch.randn(8, 4, device="meta")) is None
