"""tools/launcher_overhead.py: it times the launchers' Python with the kernels stubbed, and puts them back."""

from __future__ import annotations


def test_measures_both_launchers_and_restores_the_kernels():
    from metainfer.kernels import attention_decode, attention_prefill
    from tools import launcher_overhead

    kernels = attention_prefill._prefill_kernel, attention_decode._decode_split_kernel
    res = launcher_overhead.measure(calls=20)
    for mode in ("planned_every_call", "replayed"):
        assert res[mode]["prefill_wrapper_us"] > 0 and res[mode]["decode_wrapper_us"] > 0
    assert (attention_prefill._prefill_kernel, attention_decode._decode_split_kernel) == kernels


def test_measures_the_mla_launchers_and_restores_them():
    from metainfer.kernels import mla_attention
    from tools import launcher_overhead

    kernels = mla_attention._mla_prefill_kernel, mla_attention._mla_decode_kernel
    res = launcher_overhead.measure_mla(calls=20)
    for mode in ("planned_every_call", "replayed"):
        assert res[mode]["prefill_wrapper_us"] > 0 and res[mode]["decode_wrapper_us"] > 0
    assert (mla_attention._mla_prefill_kernel, mla_attention._mla_decode_kernel) == kernels
