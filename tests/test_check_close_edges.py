"""Edges of ``check_close`` (cute_fa/reference.py) that the tolerance tests pass through: the
bound itself (an error exactly at the allowance passes, max and RMS rules alike), an infinite
reference with a finite baseline, the messages' default name and first NaN, the RMS of
nothing."""

from __future__ import annotations

import pytest
import torch

from cute_fa.reference import _rms, check_close


def test_an_error_exactly_at_the_allowance_passes():
    # one element, ref 0, baseline error b, atol a: allowed = 2 b + a for the max and the RMS
    # (the RMS atol of fp32 at the 2**-6 floor is 0.25 * 2**-23 * 2**-6 = 2**-31 = a)
    b, a = 2.0**-10, 2.0**-31
    out = torch.tensor([2 * b + a])
    check_close(out, torch.zeros(1), torch.tensor([b]), atol=a)
    with pytest.raises(AssertionError):
        check_close(out * 1.0001, torch.zeros(1), torch.tensor([b]), atol=a)


def test_a_baseline_beside_an_infinite_reference_allows_nothing():
    ref = torch.tensor([float("-inf"), 0.0, 0.0])
    pt = torch.tensor([0.0, 0.0, 0.0])  # finite where ref is -inf: its error there is not counted
    out = torch.tensor([float("-inf"), 0.5, 0.0])
    with pytest.raises(AssertionError, match="max"):
        check_close(out, ref, pt, atol=1e-3)


def test_messages_name_out_and_the_first_nan():
    x = torch.zeros(2, 3)
    x[1, 2] = float("nan")
    with pytest.raises(AssertionError) as info:
        check_close(x, torch.zeros(2, 3), torch.zeros(2, 3))
    assert str(info.value) == "out: 1 NaN elements (first at (1, 2))"


def test_rms_of_nothing_is_zero():
    assert _rms(torch.empty(0)) == 0.0
    assert _rms(torch.tensor([3.0, -4.0])) == pytest.approx((12.5) ** 0.5)
