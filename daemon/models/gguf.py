"""Reading GGUF headers without loading weights: metadata values, the facts a lock records, tensor sizes.

gguf.GGUFReader builds an object per vocabulary entry (ten seconds for Gemma's 262k tokens);
the readers here walk the key/value section, skipping arrays, and the tensor-info section,
and never touch tensor data. Every file is opened without blocking and refused unless it is
a regular file.
"""

from __future__ import annotations

import collections
import os
import re
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from edgellmd.files import UnsuitableFile, open_regular


class GgufError(Exception):
    """Not a (readable) GGUF file; the message says why."""


GGUF_MAGIC: Final = b"GGUF"
# GGUF metadata value types (gguf.GGUFValueType) and the sizes of the fixed-size ones.
_SCALAR: Final = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING: Final = 8
_ARRAY: Final = 9
_U64: Final = struct.Struct("<Q")
_SKIP_BLOCK: Final = 1 << 20
# Metadata entries: a real model's header holds tens (a few hundred at most); llama.cpp compares
# each key with every one before it, so a header of more than this would not load there either.
MAX_KV: Final = 65_536
# The items one walk of a header visits one by one (its metadata entries, the elements of its
# arrays of strings or arrays, its tensors), spent as each count is declared: a header is read
# before its file is verified, to refuse an over-budget load before copying it, and a file of a
# model's size could declare tens of millions of empty strings, a Python loop apiece (minutes
# of the registry's lock for an unverified file). A real vocabulary with its merges is about a
# million (262k tokens; or 150k to 500k tokens and merges): twice that, and the walk is refused.
MAX_HEADER_ITEMS: Final = 2_000_000
_MAX_STRING: Final = 64 * 1024 * 1024
# What read_gguf_values keeps: a header is read before its file is verified, in the daemon, and
# a file of a real model's size could hold gigabytes of metadata strings. A string value past
# MAX_KEPT_STRING, or any value once MAX_KEPT_BYTES are kept, is walked past and not kept (a
# real header's scalars and strings, its vocabulary arrays skipped, are a few hundred KiB).
MAX_KEPT_STRING: Final = 1024 * 1024
MAX_KEPT_BYTES: Final = 32 * 1024 * 1024
_ENTRY_BYTES: Final = 100  # what a kept entry costs beyond its key's and string's bytes


class HeaderReader:
    """Just enough of a GGUF reader to pull scalar metadata out of the header.

    gguf.GGUFReader builds an object per vocabulary entry (ten seconds for Gemma's 262k
    tokens); this walks the key/value section, skipping arrays, and never touches tensors.
    """

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.size = os.fstat(fh.fileno()).st_size
        self.left = MAX_HEADER_ITEMS  # items this walk may still visit one by one

    def spend(self, items: int) -> None:
        """Count `items` about to be visited one by one against MAX_HEADER_ITEMS."""
        self.left -= items
        if self.left < 0:
            raise GgufError(f"the header declares more than {MAX_HEADER_ITEMS} metadata items and tensors")

    def read(self, n: int) -> bytes:
        data: bytes = self.fh.read(n)
        if len(data) != n:
            raise GgufError("not a GGUF file: the header is truncated")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.scalar("<Q")
        if n > _MAX_STRING:
            raise GgufError("not a GGUF file: absurd string length in the header")
        return self.read(n)

    def skip(self, n: int) -> None:
        """Move past `n` bytes, which must be in the file (a declared length of 2**63 is not)."""
        if n > self.size - self.fh.tell():
            raise GgufError("not a GGUF file: the header is truncated")
        self.fh.seek(n, os.SEEK_CUR)

    def skip_strings(self, count: int) -> None:
        """Move past `count` strings (a length, then its bytes), their lengths read from blocks
        in memory: a file call per string took a second a million."""
        unpack = _U64.unpack_from
        pos = self.fh.tell()
        while count:
            block = self.fh.read(_SKIP_BLOCK)
            end = len(block)
            if end < _U64.size:
                raise GgufError("not a GGUF file: the header is truncated")
            off = 0
            while count and off + _U64.size <= end:
                n = unpack(block, off)[0]
                if n > _MAX_STRING:
                    raise GgufError("not a GGUF file: absurd string length in the header")
                off += _U64.size + n
                count -= 1
            pos += off  # past the last string whose length was read (perhaps past this block)
            if pos > self.size:
                raise GgufError("not a GGUF file: the header is truncated")
            self.fh.seek(pos)

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.read(struct.calcsize(_SCALAR[vtype]))
        elif vtype == _STRING:
            self.skip(self.scalar("<Q"))
        elif vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALAR:
                self.skip(count * struct.calcsize(_SCALAR[etype]))
            elif etype == _STRING:  # a vocabulary: walked in memory, a block at a time
                self.spend(count)
                self.skip_strings(count)
            elif etype == _ARRAY:  # llama.cpp's reader refuses them too (an invalid type there)
                raise GgufError("not a GGUF file: an array of arrays in the header")
            else:
                raise GgufError(f"not a GGUF file: unknown metadata type {etype}")
        else:
            raise GgufError(f"not a GGUF file: unknown metadata type {vtype}")


def read_gguf_values(path: Path) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF header (arrays skipped, weights never read;
    what is kept is bounded: MAX_KEPT_STRING, MAX_KEPT_BYTES).

    GgufError for anything but a regular GGUF file (a FIFO or a device is refused, never read).
    """
    try:
        walk = _walk(path)
    except UnsuitableFile as exc:
        raise GgufError(exc.describe("the file")) from None
    except OSError as exc:
        raise GgufError(f"cannot read: {exc.strerror}") from None
    if walk.values is None:
        raise GgufError(walk.error)
    return dict(walk.values)


def read_gguf_facts(path: Path) -> dict[str, str | int]:
    """Architecture, file type and context length from a GGUF header (weights are not read)."""
    import gguf  # noqa: PLC0415 - heavy import (numpy), only needed when a model is checked

    values = read_gguf_values(path)
    arch = values.get("general.architecture")
    if not isinstance(arch, str):
        raise GgufError("not a GGUF model file: no general.architecture")
    facts: dict[str, str | int] = {"architecture": arch}
    file_type = values.get("general.file_type")
    if isinstance(file_type, int):
        try:
            facts["file_type"] = gguf.LlamaFileType(file_type).name
        except ValueError:
            facts["file_type"] = file_type
    context = values.get(f"{arch}.context_length")
    if isinstance(context, int):
        facts["context_length"] = context
    return facts


# ---- tensor sizes -------------------------------------------------------------------------

GGML_BLOCKS: Final[Mapping[int, tuple[int, int]]] = MappingProxyType(
    {
        0: (1, 4),
        1: (1, 2),
        2: (32, 18),
        3: (32, 20),
        6: (32, 22),
        7: (32, 24),
        8: (32, 34),
        9: (32, 40),
        10: (256, 84),
        11: (256, 110),
        12: (256, 144),
        13: (256, 176),
        14: (256, 210),
        15: (256, 292),
        16: (256, 66),
        17: (256, 74),
        18: (256, 98),
        19: (256, 50),
        20: (32, 18),
        21: (256, 110),
        22: (256, 82),
        23: (256, 136),
        24: (1, 1),
        25: (1, 2),
        26: (1, 4),
        27: (1, 8),
        28: (1, 8),
        29: (256, 56),
        30: (1, 2),
        34: (256, 54),
        35: (256, 66),
        39: (32, 17),
    }
)  # F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 Q2_K..Q8_K IQ2_XXS.. I8..F64 IQ1_M BF16 TQ1_0 TQ2_0 MXFP4
_MAX_TENSORS: Final = 1 << 16  # sanity bounds against hostile headers (a real model: a few thousand)
_MAX_DIMS: Final = 4  # GGML_MAX_DIMS
_MAX_NAME: Final = 256  # ggml allows 63 bytes; leave room, refuse absurd ones
_GGUF_UINT32: Final = 4
_BLOCK: Final = re.compile(rb"blk\.(\d{1,9})\.")


@dataclass(slots=True)
class TensorInfo:
    name: bytes
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    size: int | None = None


def tensor_infos(path: Path) -> tuple[list[TensorInfo], int]:
    """The tensor-info section of a GGUF file and the size of its data section.

    GgufError for a malformed header, OSError when the file cannot be read."""
    walk = _walk(path)
    if walk.tensors is None:
        raise GgufError(walk.error)
    return [TensorInfo(*t) for t in walk.tensors], walk.data_size


# ---- one walk of a header -----------------------------------------------------------------

# One walk of a file's header serves every reader of a load (the budget's, the positions',
# the layers', the lock's facts: up to five), rather than a walk apiece: a hostile header
# costs one walk of the registry's lock. Walks are kept by the file's identity and change
# marks (device, inode, size, mtime, ctime), the last few, and only small ones: a real
# header's (a few hundred KiB of values kept, a few thousand tensors).
_WALKS_KEPT: Final = 4
_KEPT_WALK_BYTES: Final = 1024 * 1024
_KEPT_WALK_TENSORS: Final = 8192


@dataclass(frozen=True, slots=True)
class _Walk:
    values: Mapping[str, Any] | None  # None: the metadata section is malformed (error says why)
    tensors: tuple[tuple[bytes, tuple[int, ...], int, int], ...] | None  # name, dims, type, offset
    error: str
    data_size: int = 0
    kept: int = 0  # bytes of values kept (by MAX_KEPT_BYTES's count)


_walks: collections.OrderedDict[tuple[int, ...], _Walk] = collections.OrderedDict()
_walks_lock = threading.Lock()


def _walk(path: Path) -> _Walk:
    """The file's header walked once: its values and tensor infos, or why not. OSError
    (UnsuitableFile for a FIFO or a device, never read) when it cannot be read."""
    with os.fdopen(open_regular(path), "rb") as fh:
        st = os.fstat(fh.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with _walks_lock:
            walk = _walks.get(key)
            if walk is not None:
                _walks.move_to_end(key)
                return walk
        walk = _walk_header(HeaderReader(fh))
    if walk.kept <= _KEPT_WALK_BYTES and len(walk.tensors or ()) <= _KEPT_WALK_TENSORS:
        with _walks_lock:
            _walks[key] = walk
            while len(_walks) > _WALKS_KEPT:
                _walks.popitem(last=False)
    return walk


def _walk_header(header: HeaderReader) -> _Walk:
    try:
        n_tensors, values, kept, alignment = _read_metadata(header)
    except GgufError as exc:
        return _Walk(None, None, str(exc))
    try:
        tensors, data_size = _read_tensor_infos(header, n_tensors, alignment)
    except GgufError as exc:
        return _Walk(values, None, str(exc), kept=kept)
    return _Walk(values, tensors, "", data_size, kept)


def _read_metadata(header: HeaderReader) -> tuple[int, dict[str, Any], int, int]:
    """The tensor count, the values kept and their bytes, and the alignment."""
    if header.read(4) != GGUF_MAGIC:
        raise GgufError("not a GGUF file (bad magic)")
    version = header.scalar("<I")
    if version < 2:
        raise GgufError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = header.scalar("<Q"), header.scalar("<Q")
    if n_kv > MAX_KV:
        raise GgufError("not a GGUF file: absurd metadata count")
    header.spend(n_kv)
    values: dict[str, Any] = {}
    kept = 0
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        raw_key = header.string()
        vtype = header.scalar("<I")
        if vtype == _STRING:
            length = header.scalar("<Q")
            cost = _ENTRY_BYTES + len(raw_key) + length
            if length > MAX_KEPT_STRING or kept + cost > MAX_KEPT_BYTES:
                header.skip(length)
                continue
            values[raw_key.decode("utf-8", "replace")] = header.read(length).decode("utf-8", "replace")
            kept += cost
        elif vtype in _SCALAR and kept + _ENTRY_BYTES + len(raw_key) <= MAX_KEPT_BYTES:
            value = header.scalar(_SCALAR[vtype])
            if raw_key == b"general.alignment" and vtype == _GGUF_UINT32:  # llama.cpp takes no other type
                alignment = value
            values[raw_key.decode("utf-8", "replace")] = value
            kept += _ENTRY_BYTES + len(raw_key)
        elif raw_key == b"general.alignment" and vtype == _GGUF_UINT32:
            alignment = header.scalar("<I")
        else:
            header.skip_value(vtype)
    return n_tensors, values, kept, alignment


def _read_tensor_infos(
    header: HeaderReader, n_tensors: int, alignment: int
) -> tuple[tuple[tuple[bytes, tuple[int, ...], int, int], ...], int]:
    """Each tensor's name, dimensions, type and offset, and the data section's size."""
    if n_tensors > _MAX_TENSORS:
        raise GgufError("absurd tensor count")
    header.spend(n_tensors)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GgufError(f"general.alignment {alignment} is not a power of two")
    tensors = []
    for _ in range(n_tensors):
        name = header.string()
        n_dims = header.scalar("<I")
        if len(name) > _MAX_NAME or not 1 <= n_dims <= _MAX_DIMS:
            raise GgufError("absurd tensor name or dimension count")
        dims = tuple(header.scalar("<Q") for _ in range(n_dims))
        tensors.append((name, dims, header.scalar("<I"), header.scalar("<Q")))
    data_start = -(-header.fh.tell() // alignment) * alignment
    if header.size < data_start:
        raise GgufError("truncated before the tensor data")
    return tuple(tensors), header.size - data_start


# llama.cpp's table of learned absolute positions (BERT and its rerankers, GPT-2, StarCoder,
# some MPT): one row per position, so its second dimension is the positions it holds.
POSITION_EMBEDDINGS: Final = b"position_embd.weight"


def learned_positions(path: Path) -> int | None:
    """How many positions a model's learned position embeddings hold; None when it has none
    (RoPE, ALiBi: any position is computed) or when its header cannot be read (the load itself
    will say what is wrong with the file).

    llama.cpp looks a position's row up in that table with no bound of its own: a position past
    it aborts the process (GGML_ASSERT in ggml's get_rows), so no position may reach it.
    """
    try:
        infos, _ = tensor_infos(path)
    except (GgufError, ValueError, OSError):
        return None
    for info in infos:
        if info.name == POSITION_EMBEDDINGS and len(info.dims) >= 2:  # ggml dimensions (n_embd, positions)
            return info.dims[1]
    return None


def gguf_layer_bytes(path: Path) -> tuple[list[int], int]:
    """Bytes of each repeating block (`blk.N.*`) and of all other tensors, from the GGUF header.

    Sizes come from each tensor's ggml type and shape; tensors of a type not in GGML_BLOCKS
    share what is left of the data section in proportion to their element counts. Raises
    ValueError for a malformed file, OSError when it cannot be read.
    """
    try:
        infos, data_size = tensor_infos(path)
    except GgufError as exc:
        raise ValueError(f"{path}: {exc}") from None
    unknown: list[tuple[TensorInfo, int]] = []
    known = 0
    for info in infos:
        elements = 1
        for d in info.dims:
            elements *= d
        block = GGML_BLOCKS.get(info.ggml_type)
        if block is None:
            unknown.append((info, elements))
            continue
        if info.dims[0] % block[0]:
            raise ValueError(f"{path}: tensor {info.name!r} rows do not fill whole ggml blocks")
        info.size = elements // block[0] * block[1]
        if info.offset + info.size > data_size:
            raise ValueError(f"{path}: tensor {info.name!r} extends past the end of the file")
        known += info.size
    if unknown:
        left, weight = max(0, data_size - known), sum(e for _, e in unknown) or 1
        for info, elements in unknown:
            info.size = left * elements // weight
    layers: dict[int, int] = {}
    other = 0
    for info in infos:
        match = _BLOCK.match(info.name)
        if match is None:
            other += info.size or 0
        else:
            layers[int(match[1])] = layers.get(int(match[1]), 0) + (info.size or 0)
    if layers and max(layers) >= len(infos):
        raise ValueError(f"{path}: block numbers run past the tensor count")
    return [layers.get(i, 0) for i in range(max(layers, default=-1) + 1)], other
