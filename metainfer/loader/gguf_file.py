"""A GGUF v2/v3 header reader that decodes only what the loader asks for.

gguf-py's GGUFReader builds a numpy view for every element of every array field: ~2 s on the embedded SmolLM2
file, nearly all of it the tokenizer's ~150k vocabulary and merge entries that the weight loader never reads.
Here an array field is only stepped over (its element type, count and byte offset kept), and decoded when
`contents()` is called. Scalars, strings, the tensor table and the tensor data views follow GGUFReader's layout
(same field names and values, tensor shapes, types and data views), so `gguf.quants.dequantize` takes our data
exactly as it takes gguf-py's.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALAR_FORMAT = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                  GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                  GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
                  GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}
# ggml types whose data GGUFReader exposes as typed elements; every other type is raw bytes in blocks
_PLAIN_DTYPE = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


class _Field:
    """One key/value (`offset`: where its key starts): a scalar or string decoded at parse time; an array kept as
    its item type, count and the offset of its first item."""

    __slots__ = ("_file", "count", "item_type", "items_offset", "name", "offset", "type", "value")

    def __init__(self, file: _GGUFFile, name: str, offset: int, type: GGUFValueType, value: Any = None,
                 item_type: GGUFValueType | None = None, count: int = 0, items_offset: int = 0):
        self._file, self.name, self.offset, self.type = file, name, offset, type
        self.value, self.item_type, self.count, self.items_offset = value, item_type, count, items_offset

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value; for an array, the decoded list (or one element for an int index), read now."""
        if self.type != GGUFValueType.ARRAY:
            return self.value
        items = self._file._read_array(self.item_type, self.count, self.items_offset)
        return items[index_or_slice]


class _Tensor(NamedTuple):
    """A tensor-table entry; `shape` in GGUF order (innermost first), `data` a view of the mapped file."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _GGUFFile:
    """A parsed GGUF: `fields` (name -> _Field, including GGUF.version/tensor_count/kv_count as GGUFReader has
    them), `tensors` (file order), `alignment` and `data_offset`. The file stays memory-mapped while referenced."""

    def __init__(self, path: str):
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        if struct.unpack_from("<I", self._buf, 0)[0] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = struct.unpack_from("<I", self._buf, 4)[0]
        self._order = "<"
        if version & 0xFFFF == 0:  # written for the other byte order
            self._order = ">"
            version = struct.unpack_from(">I", self._buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = self._unpack("QQ", 8)
        self.fields: dict[str, _Field] = {}
        self._add(_Field(self, "GGUF.version", 4, GGUFValueType.UINT32, version))
        self._add(_Field(self, "GGUF.tensor_count", 8, GGUFValueType.UINT64, tensor_count))
        self._add(_Field(self, "GGUF.kv_count", 16, GGUFValueType.UINT64, kv_count))
        offs = 24
        for _ in range(kv_count):
            offs = self._read_kv(offs)
        infos = []
        for _ in range(tensor_count):
            name, offs = self._read_str(offs)
            (n_dims,) = self._unpack("I", offs)
            dims = self._unpack(f"{n_dims}Q", offs + 4)
            raw_type, rel = self._unpack("IQ", offs + 4 + 8 * n_dims)
            offs += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, rel))
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.type != GGUFValueType.UINT32:
                raise ValueError("Bad type for general.alignment field")
            if align.value == 0 or align.value & (align.value - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
            self.alignment = align.value
        self.data_offset = -(-offs // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("GGUF has duplicated tensor names")

    def _unpack(self, fmt: str, offset: int) -> tuple:
        return struct.unpack_from(self._order + fmt, self._buf, offset)

    def _read_str(self, offset: int) -> tuple[str, int]:
        (n,) = self._unpack("Q", offset)
        start = offset + 8
        return str(self._buf[start:start + n], "utf-8"), start + n

    def _add(self, field: _Field) -> None:
        if field.name in self.fields:
            raise KeyError(f"Duplicate {field.name} already in list at offset {field.offset}")
        self.fields[field.name] = field

    def _read_kv(self, offs: int) -> int:
        start = offs
        name, offs = self._read_str(offs)
        (raw,) = self._unpack("I", offs)
        vtype = GGUFValueType(raw)
        offs += 4
        if vtype == GGUFValueType.ARRAY:
            raw_item, count = self._unpack("IQ", offs)
            item_type = GGUFValueType(raw_item)
            self._add(_Field(self, name, start, vtype, item_type=item_type, count=count, items_offset=offs + 12))
            return self._skip_array(item_type, count, offs + 12)
        value, end = self._read_value(vtype, offs)
        self._add(_Field(self, name, start, vtype, value))
        return end

    def _read_value(self, vtype: GGUFValueType, offs: int) -> tuple[Any, int]:
        if vtype == GGUFValueType.STRING:
            return self._read_str(offs)
        fmt = _SCALAR_FORMAT.get(vtype)
        if fmt is None:
            raise ValueError(f"Unknown/unhandled field type {vtype}")
        return self._unpack(fmt, offs)[0], offs + struct.calcsize(fmt)

    def _skip_array(self, item_type: GGUFValueType, count: int, offs: int) -> int:
        """The offset just past `count` items of `item_type` starting at `offs`, decoding none of them: a string
        array needs each length read (the one loop over the vocabulary, ~10 ms for SmolLM2's ~98k strings)."""
        if item_type in _SCALAR_FORMAT:
            return offs + count * struct.calcsize(_SCALAR_FORMAT[item_type])
        if item_type == GGUFValueType.STRING:
            unpack, buf, length = struct.Struct(self._order + "Q").unpack_from, self._buf, 0
            for _ in range(count):
                (length,) = unpack(buf, offs)
                offs += 8 + length
            return offs
        if item_type == GGUFValueType.ARRAY:
            for _ in range(count):
                raw_item, n = self._unpack("IQ", offs)
                offs = self._skip_array(GGUFValueType(raw_item), n, offs + 12)
            return offs
        raise ValueError(f"Unknown/unhandled field type {item_type}")

    def _read_array(self, item_type: GGUFValueType, count: int, offs: int) -> list:
        """Decode an array field's items (nested arrays as nested lists)."""
        if item_type in _SCALAR_FORMAT:
            return list(self._unpack(f"{count}{_SCALAR_FORMAT[item_type]}", offs))
        items = []
        for _ in range(count):
            if item_type == GGUFValueType.ARRAY:
                raw_item, n = self._unpack("IQ", offs)
                items.append(self._read_array(GGUFValueType(raw_item), n, offs + 12))
                offs = self._skip_array(GGUFValueType(raw_item), n, offs + 12)
            else:
                item, offs = self._read_value(item_type, offs)
                items.append(item)
        return items

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, rel_offset: int) -> _Tensor:
        """GGUFReader's view of a tensor: typed elements for the plain types, else uint8 blocks
        (quant_shape_to_byte_shape), in numpy order (outermost first)."""
        qtype = GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block_size
        np_dims = tuple(reversed(dims))
        start = self.data_offset + rel_offset
        dtype = _PLAIN_DTYPE.get(qtype)
        if dtype is None:
            dtype, count, np_dims = np.uint8, n_bytes, quant_shape_to_byte_shape(np_dims, qtype)
        else:
            dtype, count = np.dtype(dtype).newbyteorder(self._order), n_elements
        data = np.frombuffer(self.data, dtype=dtype, count=count, offset=start).reshape(np_dims)
        return _Tensor(name, qtype, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data)
