"""Comparing floating-point results in units in the last place (ulp) of their own dtype.

Two correct kernels that sum in different orders (a SIMD reduction against torch's) agree in float32 to a few
float ulps; rounded to bfloat16 or float16 that difference flips a result that lies near a rounding boundary by
one step of the narrow dtype, and which results flip depends on the CPU's vector width. So a narrow-dtype
result computed through a reduction is compared within one ulp, never bit-exactly; elementwise ops that round
at the same points as torch's op sequence still compare exactly.
"""

from __future__ import annotations

import torch

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many representable values of the (shared) dtype lie between each pair, as int64; -0.0 == 0.0."""
    assert actual.dtype == expected.dtype and actual.dtype in _BITS, (actual.dtype, expected.dtype)
    bits = _BITS[actual.dtype]
    sign_bit = torch.iinfo(bits).min

    def ordered(t: torch.Tensor) -> torch.Tensor:
        raw = t.contiguous().view(bits).to(torch.int64)
        return torch.where(raw < 0, sign_bit - raw, raw)  # sign-magnitude -> one monotone integer line

    return (ordered(actual) - ordered(expected)).abs()


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1) -> None:
    """Every element of ``actual`` within ``ulps`` representable steps of ``expected`` (same dtype, no NaN)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not actual.isnan().any() and not expected.isnan().any(), "NaN in a compared tensor"
    distance = ulp_distance(actual, expected)
    worst = int(distance.max()) if distance.numel() else 0
    if worst > ulps:
        at = int(distance.argmax())
        raise AssertionError(f"{int((distance > ulps).sum())} of {distance.numel()} elements differ by more than "
                             f"{ulps} ulp of {actual.dtype}; worst {worst} ulp at flat index {at}: "
                             f"{actual.flatten()[at].item()} vs {expected.flatten()[at].item()}")
