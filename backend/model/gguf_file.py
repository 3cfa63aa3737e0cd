"""A GGUF file's metadata and tensor table, read by hand from the memory-mapped file.

gguf-py's GGUFReader builds a numpy view per item of every array (about 4 s over the 147k items of a 49k-token
vocabulary); this reads the same table in a fraction of that, and skips arrays' items altogether where the caller
needs no vocabulary (the weights' loader). Tensors come back as their raw bytes, memory-mapped: nothing is read
from disk until a tensor is used.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY


@dataclass
class RawTensor:
    type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # rows first (ggml lists dims fastest first)
    raw: np.ndarray  # uint8 [*shape[:-1], bytes per row], memory-mapped
    offset: int  # of its first byte in the file

    @property
    def type_name(self) -> str:
        return self.type.name

    def release(self) -> None:
        """Drops the file's pages this tensor touched from this process (MADV_DONTNEED): once its bytes are copied
        elsewhere, a mapped page that stays counts as resident memory twice."""
        page = mmap.PAGESIZE
        start = self.offset // page * page
        end = self.offset + self.raw.nbytes
        self.raw._mmap.madvise(mmap.MADV_DONTNEED, start, -(-(end - start) // page) * page)


def read_gguf(path: str | Path, arrays: bool = True) -> tuple[dict, dict[str, RawTensor]]:
    """(metadata key -> (value, type, array item type), tensor name -> RawTensor). With `arrays` False, arrays'
    values are None (their items are stepped over, not decoded)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 24  # past the magic, the version and the two counts

        def read(fmt):
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values

        def value(vtype):
            nonlocal pos
            if vtype == _STRING:
                pos += 8 + (n := read("Q")[0])
                return buf[pos - n : pos].decode()
            return read(_SCALAR[vtype])[0]

        def skip(vtype, n):
            nonlocal pos
            if vtype != _STRING:
                pos += n * struct.calcsize("<" + _SCALAR[vtype])
                return
            for _ in range(n):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]

        n_tensors, n_keys = struct.unpack_from("<QQ", buf, 8)
        fields, table = {}, []
        for _ in range(n_keys):
            key, vtype = value(_STRING), gguf.GGUFValueType(read("I")[0])
            if vtype == _ARRAY:
                item, n = read("IQ")
                item = gguf.GGUFValueType(item)
                if arrays:
                    fields[key] = ([value(item) for _ in range(n)], vtype, item)
                else:
                    skip(item, n)
                    fields[key] = (None, vtype, item)
            else:
                fields[key] = (value(vtype), vtype, None)
        for _ in range(n_tensors):
            name, dims = value(_STRING), read(f"{read('I')[0]}Q")
            table.append((name, dims, *read("IQ")))
    align = fields.get("general.alignment", (32,))[0]
    start = -(-pos // align) * align
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, qtype, offset in table:
        qtype = gguf.GGMLQuantizationType(qtype)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = data[start + offset :][: math.prod(dims) // block * size]
        shape = tuple(int(d) for d in dims[::-1])
        tensors[name] = RawTensor(qtype, shape, raw.reshape(*shape[:-1], -1), start + offset)
    return fields, tensors
