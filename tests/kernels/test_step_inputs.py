"""A step's input ids and positions from the packed staging fields (kernels/step_inputs.py): the Triton
kernel (interpreted on the CPU) against the torch reference, which the CPU engine runs."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels.step_inputs import step_inputs_ref, step_inputs_triton
from tests.helpers.aot import run_aot_check
from tests.helpers.kernel_devices import DEVICE

pytest.importorskip("triton")


def _fields(num_tokens: int, num_sampled: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150_000, (num_tokens,), generator=gen, dtype=torch.int32)
    src = torch.randint(0, num_sampled, (num_tokens,), generator=gen, dtype=torch.int32)
    src[::3] = -1  # a known token; the others are PENDING rows reading `sampled`
    positions = torch.randint(0, 40_000, (num_tokens,), generator=gen, dtype=torch.int32)
    sampled = torch.randint(0, 150_000, (num_sampled,), generator=gen, dtype=torch.int64)
    return [t.to(DEVICE) for t in (ids, src, positions, sampled)]


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300, 2500])  # 2500: three programs, a ragged last one
def test_step_inputs_triton_equals_ref(num_tokens):
    fields = _fields(num_tokens, 16, seed=num_tokens)
    ids, src, positions, sampled = fields
    expected_ids, expected_pos = step_inputs_ref(*fields)
    got_ids, got_pos = step_inputs_triton(*fields)
    assert got_ids.dtype == got_pos.dtype == torch.int64
    assert torch.equal(got_ids, expected_ids) and torch.equal(got_pos, expected_pos)
    if num_tokens >= 2:  # both kinds of rows are present and taken from the right place
        pending = src >= 0
        assert pending.any() and (~pending).any()
        assert torch.equal(got_ids[pending], sampled[src[pending].long()])
        assert torch.equal(got_ids[~pending], ids[~pending].long())


def test_step_inputs_triton_names_a_bad_field():
    ids, src, positions, sampled = _fields(5, 4, seed=1)
    with pytest.raises(ValueError, match="src"):
        step_inputs_triton(ids, src.long(), positions, sampled)
    with pytest.raises(ValueError, match="positions"):
        step_inputs_triton(ids, src, positions[:3], sampled)
    with pytest.raises(ValueError, match="sampled"):
        step_inputs_triton(ids, src, positions, sampled.int())


@pytest.mark.slow
def test_aot_compile_sm90_step_inputs():
    """The kernel compiles for sm_90 (with and without PDL) as one variant for every token count."""
    out = run_aot_check(["step_inputs"])  # cases T = 1, 512, 8192, the first also with PDL
    assert "2 distinct kernels compiled" in out, out[-2000:]
