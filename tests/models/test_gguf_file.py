"""loader/gguf_file.py (our GGUF header reader) against the reference, gguf-py's GGUFReader: the same fields and
values (arrays decoded on request), the same tensor table, data views that dequantize to the same arrays. On a
small file written here with gguf-py's GGUFWriter (every scalar kind, arrays, plain and quantized tensors, a custom
alignment, both byte orders) and on the embedded SmolLM2 GGUF."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from metainfer.loader.gguf_file import _GGUFFile
from tests.helpers.tiny_models import smollm2_gguf

Q = gguf.GGMLQuantizationType
_NO_DEQUANTIZE = {Q.I8, Q.I16, Q.I32, Q.I64, Q.F64}  # gguf.quants.dequantize has no path for these


def _write_mixed(path: str, big_endian: bool = False) -> None:
    """Every scalar kind, string/int/float/bool/nested arrays, an empty array, and tensors of several ggml types
    (quantized ones only little-endian: gguf-py's writer byte-swaps typed data only)."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    writer.add_custom_alignment(64)
    writer.add_string("test.string", "héllo wörld")
    writer.add_string("test.empty_string", "")
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float32("test.f32", 1e-5)
    writer.add_float64("test.f64", 1 / 3)
    writer.add_bool("test.true", True)
    writer.add_bool("test.false", False)
    writer.add_array("test.strings", ["a", "", "ü", "<|endoftext|>", "x" * 300])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.empty", [])
    writer.add_uint32("test.after_arrays", 42)  # read at the offset the arrays were stepped over to
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5, 64)).astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, (7,), dtype=np.int32))
    if not big_endian:
        for qtype in (Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.BF16):
            weights = rng.standard_normal((4, 96)).astype(np.float32)
            writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_same(path: str) -> None:
    ours, ref = _GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        got, want = ours.fields[name].contents(), field.contents()
        assert got == want and type(got) is type(want), name
        assert ours.fields[name].offset == field.offset, name
        assert ours.fields[name].type == field.types[0], name
        if field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data):
            assert ours.fields[name].contents(-1) == field.contents(len(field.data) - 1), name
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape.tolist() == theirs.shape.tolist(), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.n_elements, theirs.n_bytes, theirs.data_offset), mine.name
        assert mine.data.shape == theirs.data.shape and mine.data.dtype == theirs.data.dtype, mine.name
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name
        if mine.tensor_type not in _NO_DEQUANTIZE:  # what the loader calls; NaN where gguf-py misreads big-endian F16
            assert np.array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                                  gguf.quants.dequantize(theirs.data, theirs.tensor_type), equal_nan=True), mine.name


@pytest.mark.parametrize("big_endian", [False, True])
def test_written_gguf_matches_gguf_py(tmp_path, big_endian):
    path = str(tmp_path / "mixed.gguf")
    _write_mixed(path, big_endian)
    _assert_same(path)
    ours = _GGUFFile(path)
    assert ours.fields["test.after_arrays"].contents() == 42 and ours.alignment == 64
    assert {t.tensor_type for t in ours.tensors} >= ({Q.F32, Q.F16, Q.I32} if big_endian
                                                     else {Q.F32, Q.F16, Q.I32, Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.BF16})


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        _GGUFFile(str(path))


@pytest.mark.slow
def test_embedded_smollm2_matches_gguf_py():
    """Every field (the 49k-token vocabulary and merges decoded on request) and all 272 tensors dequantized."""
    _assert_same(smollm2_gguf())
