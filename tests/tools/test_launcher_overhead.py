"""tools/launcher_overhead.py: it times the launchers' Python with the kernels stubbed, and puts them back."""

from __future__ import annotations


def _assert_times_and_restores(measure, kernels) -> None:
    """`measure(calls=20)` reports both wrappers' time in both modes, and `kernels()` (the module attributes it
    stubs) reads the same before and after."""
    before = kernels()
    res = measure(calls=20)
    for mode in ("planned_every_call", "replayed"):
        assert res[mode]["prefill_wrapper_us"] > 0 and res[mode]["decode_wrapper_us"] > 0
    assert kernels() == before


def test_measures_both_launchers_and_restores_the_kernels():
    from metainfer.kernels import attention_decode, attention_prefill
    from tools import launcher_overhead

    _assert_times_and_restores(launcher_overhead.measure,
                               lambda: (attention_prefill._prefill_kernel, attention_decode._decode_split_kernel))


def test_measures_the_mla_launchers_and_restores_them():
    from metainfer.kernels import mla_attention
    from tools import launcher_overhead

    _assert_times_and_restores(launcher_overhead.measure_mla,
                               lambda: (mla_attention._mla_prefill_kernel, mla_attention._mla_decode_kernel))
