"""The ulp comparison the narrow-dtype kernel tests use (tests/ulp.py)."""

from __future__ import annotations

import pytest
import torch

from tests.ulp import assert_within_ulps, ulp_distance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_neighbours_are_one_ulp_apart_across_zero_and_binades(dtype) -> None:
    values = torch.tensor([1.0, 1.6, -1.6, 2.0, 1e-3, -1e-3], dtype=dtype)
    up = torch.nextafter(values, torch.full_like(values, float("inf")))
    assert ulp_distance(up, values).tolist() == [1] * len(values)
    assert ulp_distance(torch.tensor([0.0, -0.0], dtype=dtype), torch.tensor([-0.0, 0.0], dtype=dtype)).tolist() == [0, 0]
    tiny = torch.tensor([torch.finfo(dtype).tiny], dtype=dtype)
    below_zero = torch.nextafter(torch.zeros(1, dtype=dtype), -torch.ones(1, dtype=dtype))
    above_zero = torch.nextafter(torch.zeros(1, dtype=dtype), torch.ones(1, dtype=dtype))
    assert int(ulp_distance(below_zero, above_zero)) == 2  # the smallest negative, zero, the smallest positive
    assert int(ulp_distance(tiny, -tiny)) > 2


def test_one_bfloat16_step_passes_and_two_fail() -> None:
    expected = torch.tensor([1.6, 0.5, -3.0], dtype=torch.bfloat16)
    one = expected.clone()
    one[0] = torch.nextafter(one[0:1], torch.tensor([2.0], dtype=torch.bfloat16))[0]  # the 0.0078 at 1.6
    assert_within_ulps(one, expected, ulps=1)
    two = torch.nextafter(one, torch.full_like(one, 2.0))
    with pytest.raises(AssertionError, match="more than 1 ulp"):
        assert_within_ulps(two, expected, ulps=1)
    with pytest.raises(AssertionError, match="NaN"):
        assert_within_ulps(torch.tensor([float("nan")], dtype=torch.bfloat16), expected[:1])
