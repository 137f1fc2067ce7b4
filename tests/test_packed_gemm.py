"""The oneDNN-packed weights (`worker.layers.packed_gemm`) of the LM head and the projections give F.linear's
results, follow reloads and ties, and step aside where they cannot serve (packing off, a dtype oneDNN does
not compute natively, few rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers import packed_gemm
from worker.layers.linear import PROJECTION_MIN_ROWS, ColumnParallelLinear, ParallelLMHead, RowParallelLinear

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
    assert head.gemm.packed is not None  # made at the first call (used from MIN_ROWS rows)
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
    assert head.gemm.packed is None


def test_bfloat16_packs_only_where_onednn_computes_it() -> None:
    head = _head(300, 32, torch.bfloat16)
    x = torch.randn(16, 32).bfloat16()
    with torch.inference_mode():
        got = head.compute_logits(x)
    assert (head.gemm.packed is not None) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.testing.assert_close(got, F.linear(x, head.weight), rtol=2e-2, atol=2e-2)


def test_not_packed_off_the_cpu_or_in_float16() -> None:
    assert packed_gemm.pack_for_gemm(torch.randn(8, 4).half()) is None
    assert packed_gemm.pack_for_gemm(torch.randn(8, 4, device="meta")) is None


def _column(in_features: int, outs: list[int], bias: bool) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(in_features, [(f"s{i}", n) for i, n in enumerate(outs)], bias, torch.float32)
    for i, n in enumerate(outs):
        layer.load_shard(layer.weight, torch.randn(n, in_features), f"s{i}")
    if bias:
        layer.bias.data.copy_(torch.randn(sum(outs)))
    return layer


@pytest.mark.parametrize("rows", [1, PROJECTION_MIN_ROWS - 1, PROJECTION_MIN_ROWS, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_projections_equal_f_linear_at_every_row_count(rows: int, bias: bool) -> None:
    column = _column(512, [512, 256, 256], bias)  # a qkv-like packing
    row = RowParallelLinear(1408, 512, bias, torch.float32)
    row.load_shard(row.weight, torch.randn(512, 1408))
    if bias:
        row.load_shard(row.bias, torch.randn(512))
    x, h = torch.randn(rows, 512), torch.randn(rows, 1408)
    with torch.inference_mode():
        got_column, got_row = column(x), row(h)
    # sums of 512-1408 products of N(0, 1) reach ~100: summation order moves the last ~1e-4 of them
    torch.testing.assert_close(got_column, F.linear(x, column.weight, column.bias), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got_row, F.linear(h, row.weight, row.bias), rtol=1e-4, atol=1e-3)
    assert column.gemm.packed is not None and row.gemm.packed is not None


def test_a_projection_reloaded_in_place_is_packed_again() -> None:
    layer = _column(64, [96], bias=False)
    x = torch.randn(PROJECTION_MIN_ROWS, 64)
    with torch.inference_mode():
        layer(x)
        ptr = layer.weight.data_ptr()
        layer.load_shard(layer.weight, torch.randn(96, 64), "s0")  # same storage, new values
        assert layer.weight.data_ptr() == ptr
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
