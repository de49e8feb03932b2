"""The safetensors format: the one place autotp reads and writes it.

Whole files of small tensors (per-rank training checkpoints) go through the `safetensors` library.
Two things it cannot do are written here by hand:
- streaming a file whose tensors arrive one at a time (a full checkpoint gathered tensor by tensor):
  the library wants every tensor in memory at once. The header is fixed up front instead.
- reading only the runs of rows a rank holds with plain reads into the destination tensor: the
  library's slices go through mmap, whose touched pages count against the process's memory.
Errors name the file and the numbers.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..planning.sharding import Partition
from .errors import CheckpointError, FormatError

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    """Writes one safetensors file whose tensor list is fixed up front, tensor by tensor, in order."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in DTYPES:
                raise TypeError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data start to 8 bytes
        self._pending = [(name, dtype, tuple(shape)) for name, dtype, shape in entries]
        self._file = open(path, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._pending.pop(0)
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != expected:
            raise RuntimeError(f"safetensors writer expected {expected}, got {got}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))

    def close(self) -> None:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} tensors were never written, first {self._pending[0][0]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


NAMES = {name: dtype for dtype, name in DTYPES.items()}
_CHUNK_BYTES = 64 << 20  # column slices are read this many bytes of whole rows at a time
_MAX_HEADER_BYTES = 100_000_000  # the `safetensors` library's limit


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """The header (name -> dtype, shape, offsets) and where the data starts, validated as `safetensors` does.

    Every tensor's bytes must match its shape and dtype, and the tensors must tile the data after
    the header exactly (no overlap, no gap, nothing past the end or left over), so that a corrupt
    file is reported here, naming the file and the tensor, instead of loading the wrong bytes.
    """
    size = file.stat().st_size
    with file.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length <= 0 or length > _MAX_HEADER_BYTES or 8 + length > size:
            raise FormatError(f"{file}: corrupt safetensors header (says {length} bytes, file has {size})")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise FormatError(f"{file}: corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{file}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise FormatError(f"{file}: __metadata__ must map names to strings, got {metadata!r}")
    for name, entry in header.items():
        _check_entry(file, name, entry)
    end, previous = 0, None
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = entry["data_offsets"]
        if begin < end:
            raise FormatError(f"{file}: tensor {name} starts at byte {begin} of the data, inside tensor {previous}, "
                              f"which ends at byte {end}")
        if begin > end:
            raise FormatError(f"{file}: tensor {name} starts at byte {begin} of the data, {begin - end} bytes after "
                              f"the previous tensor ends (the format allows no gaps)")
        end, previous = stop, name
        if 8 + length + end > size:
            raise FormatError(f"{file}: truncated: its tensors need {8 + length + end} bytes (tensor {name} ends "
                              f"there), the file has {size}")
    if 8 + length + end != size:
        raise FormatError(f"{file}: {size - 8 - length - end} bytes after the last tensor's data (the tensors end at "
                          f"byte {8 + length + end}, the file has {size})")
    return header, 8 + length


def _check_entry(file: Path, name: str, entry: object) -> None:
    if not isinstance(entry, dict):
        raise FormatError(f"{file}: tensor {name} has the header entry {entry!r}, not an object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise FormatError(f"{file}: tensor {name} has no {' or '.join(missing)} in the header")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in NAMES:
        raise FormatError(f"{file}: tensor {name} has dtype {dtype!r}, which autotp does not read (it reads "
                          f"{', '.join(sorted(NAMES))})")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise FormatError(f"{file}: tensor {name} has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise FormatError(f"{file}: tensor {name} has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    nbytes = math.prod(shape) * NAMES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise FormatError(f"{file}: tensor {name} of shape {tuple(shape)} and dtype {dtype} needs {nbytes} bytes, "
                          f"its data_offsets {offsets} hold {offsets[1] - offsets[0]}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_rows(f, entry: dict, data_start: int, partition: Partition | None, rank: int) -> torch.Tensor:
    """One tensor from an open file: whole, or only the runs of rows along `partition.dim` that `rank` holds.

    `entry` comes from `read_header`, which validated it.
    """
    dtype = NAMES[entry["dtype"]]
    shape = list(entry["shape"])
    begin = data_start + entry["data_offsets"][0]
    if partition is None:
        return _read_into(f, begin, torch.empty(shape, dtype=dtype))
    dim = partition.dim
    if dim >= len(shape) or shape[dim] != partition.full_size:
        raise FormatError(f"{f.name}: a tensor of shape {tuple(shape)} cannot be split into {partition.full_size} "
                          f"rows along dim {dim}")
    local = shape.copy()
    local[dim] = partition.local_size(rank)
    out = torch.empty(local, dtype=dtype)
    outer = torch.Size(shape[:dim]).numel()
    inner = torch.Size(shape[dim + 1:]).numel() * dtype.itemsize  # bytes of one index along dim
    span = shape[dim] * inner  # bytes of one outer index
    out_rows = out.view(outer, local[dim], -1) if out.numel() else out
    if dim == 0:  # every run is one contiguous range of the file
        offset = 0
        for start, length in partition.runs[rank]:
            _read_into(f, begin + start * inner, out_rows[0, offset:offset + length])
            offset += length
        return out
    step = max(1, _CHUNK_BYTES // max(span, 1))
    for first in range(0, outer, step):
        count = min(step, outer - first)
        chunk = _read_into(f, begin + first * span, torch.empty((count, shape[dim], inner // dtype.itemsize), dtype=dtype))
        offset = 0
        for start, length in partition.runs[rank]:
            out_rows[first:first + count, offset:offset + length] = chunk[:, start:start + length]
            offset += length
    return out


def _read_into(f, position: int, out: torch.Tensor) -> torch.Tensor:
    f.seek(position)
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    if f.readinto(view) != len(view):
        raise FormatError(f"{f.name}: ended early while reading {len(view)} bytes at offset {position}")
    return out


def write_tensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """A whole file of tensors at once (safetensors refuses shared storage: tied entries are stored as copies)."""
    seen: set[int] = set()
    unshared = {}
    for name, tensor in tensors.items():
        key = tensor.untyped_storage().data_ptr()
        unshared[name] = (tensor.clone() if key in seen else tensor).contiguous()
        seen.add(key)
    save_file(unshared, file)


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file, with corruption reported as a `CheckpointError` naming the file."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        return load_file(file)
    except Exception as err:  # safetensors reports corruption with several error types
        raise CheckpointError(f"{file}: cannot be read as safetensors ({err})") from None


def open_tensors(file: Path):
    """A lazily read file (`keys()`, `get_tensor(name)`, `get_slice(name)`), for reading tensors one at a time."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:  # safetensors reports corruption with several error types
        raise CheckpointError(f"{file}: cannot be read as safetensors ({err})") from None
