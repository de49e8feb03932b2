"""The safetensors format: the one place autotp reads and writes it.

Whole files of small tensors (per-rank training checkpoints) go through the `safetensors` library.
Two things it cannot do are written here by hand:
- streaming a file whose tensors arrive one at a time (a full checkpoint gathered tensor by tensor):
  the library wants every tensor in memory at once. The header is fixed up front instead, and each
  tensor's pieces are written where they belong as they come, on local filesystems partly by the
  ranks that hold them (`SafetensorsWriter`, `write_rows`).
- reading only the runs of rows a rank holds with plain reads into the destination tensor: the
  library's slices go through mmap, whose touched pages count against the process's memory.
Errors name the file and the numbers.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ...planning.sharding import Partition
from ..errors import CheckpointError, FormatError
from ..streaming import CANNOT, FullStream

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    """Writes one safetensors file whose tensor list is fixed up front, tensor by tensor, in order.

    A tensor is a `torch.Tensor` or a `FullStream` (`stream_full_to`), written with `pwrite` piece by
    piece as it arrives. On a local filesystem the other ranks write their rows of a stream into
    the file themselves (`FullStream.write_into`); elsewhere (network and FUSE filesystems, some of
    which take only sequential writes) this rank writes every byte, in order.
    Nothing is fsynced here: `autotp.io.staging` syncs the files before a swap that deletes an old
    checkpoint, the one point where a machine crash could otherwise lose both.
    """

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
        self.path = path
        self._pending = [(name, dtype, tuple(shape)) for name, dtype, shape in entries]
        self._position = 8 + len(raw)  # where the next tensor's data starts
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            st = os.fstat(self._fd)  # 0: the other ranks send their rows; else they may write them (`write_rows`)
            self._shared = file_identity(st.st_dev, st.st_ino) if local_filesystem(path) else 0
            pwrite_all(self._fd, len(raw).to_bytes(8, "little") + raw, 0)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, name: str, tensor: torch.Tensor | FullStream) -> None:
        expected = self._pending.pop(0)
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != expected:
            raise RuntimeError(f"safetensors writer expected {expected}, got {got}")
        nbytes = math.prod(expected[2]) * expected[1].itemsize
        if isinstance(tensor, torch.Tensor):
            pieces: Iterable[tuple[int, memoryview | list[memoryview]]] = [
                (0, memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
            ]
        else:
            if self._shared:
                tensor.write_into(os.fsencode(os.path.abspath(self.path)), self._shared, self._position)
            pieces = tensor.pieces()
        written = 0
        for offset, piece in pieces:
            size = sum(view.nbytes for view in piece) if isinstance(piece, list) else piece.nbytes
            if offset + size > nbytes:
                raise RuntimeError(f"{name}: a piece at byte {offset} runs past the tensor's {nbytes} bytes")
            pwrite_all(self._fd, piece, self._position + offset)
            written += size
        written += 0 if isinstance(tensor, torch.Tensor) else tensor.written_elsewhere
        if written != nbytes:
            raise RuntimeError(f"{name}: {written} of its {nbytes} bytes came")
        self._position += nbytes

    def close(self) -> None:
        os.close(self._fd)
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} tensors were never written, first {self._pending[0][0]}")


# statfs magic numbers: ext2/3/4, xfs, btrfs, tmpfs, overlay, f2fs, zfs. On these, processes of one kernel writing one
# file share its page cache; network and FUSE filesystems may keep a copy per writer, or take sequential writes only.
_LOCAL = {0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0x794C7630, 0xF2F52010, 0x2FC12FC1}


def local_filesystem(path: Path) -> bool:
    """Whether `path` is on a local filesystem (Linux `statfs`), where several processes may write one file."""
    if not sys.platform.startswith("linux"):
        return False
    buffer = ctypes.create_string_buffer(256)  # struct statfs; f_type, a long, comes first
    if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(path), buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value in _LOCAL


def file_identity(device: int, inode: int) -> int:
    """A file's (device, inode) on this boot as a nonzero int64: equal on two ranks only for one file of one kernel."""
    key = f"{_boot_id()}:{device}:{inode}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True) or 1


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return boot.read_text().strip() if boot.exists() else ""


def write_rows(path: str, identity: int, rows: list[tuple[int, memoryview]]) -> int:
    """A sender's half of `FullStream.write_into`: its rows written into the file the gathering rank has open
    (`save_pretrained` passes it to `stream_full_to`).

    0 once written; `CANNOT` where `path` is not that file (another machine, container or boot); -errno
    when a write fails (the gathering rank raises it).
    """
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return CANNOT
    try:
        st = os.fstat(fd)
        if file_identity(st.st_dev, st.st_ino) != identity:
            return CANNOT
        for position, data in rows:
            pwrite_all(fd, data, position)
        return 0
    except OSError as err:
        return -(err.errno or errno.EIO)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: memoryview | bytes | list[memoryview], position: int) -> None:
    """Every byte at `position`: `os.pwrite`, or `os.pwritev` of a list (a write may be short: Linux stops at 2 GiB
    less a page, and takes 1024 buffers a call)."""
    if isinstance(data, list):
        for first in range(0, len(data), 1024):
            group = data[first : first + 1024]
            done, size = os.pwritev(fd, group, position), sum(view.nbytes for view in group)
            if done < size:
                pwrite_all(fd, b"".join(group)[done:], position + done)
            position += size
        return
    view = memoryview(data).cast("B")
    while view.nbytes:
        done = os.pwrite(fd, view, position)
        view, position = view[done:], position + done


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
            raise FormatError(
                f"{file}: tensor {name} starts at byte {begin} of the data, inside tensor {previous}, "
                f"which ends at byte {end}"
            )
        if begin > end:
            raise FormatError(
                f"{file}: tensor {name} starts at byte {begin} of the data, {begin - end} bytes after "
                f"the previous tensor ends (the format allows no gaps)"
            )
        end, previous = stop, name
        if 8 + length + end > size:
            raise FormatError(
                f"{file}: truncated: its tensors need {8 + length + end} bytes (tensor {name} ends "
                f"there), the file has {size}"
            )
    if 8 + length + end != size:
        raise FormatError(
            f"{file}: {size - 8 - length - end} bytes after the last tensor's data (the tensors end at "
            f"byte {8 + length + end}, the file has {size})"
        )
    return header, 8 + length


def _check_entry(file: Path, name: str, entry: object) -> None:
    if not isinstance(entry, dict):
        raise FormatError(f"{file}: tensor {name} has the header entry {entry!r}, not an object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise FormatError(f"{file}: tensor {name} has no {' or '.join(missing)} in the header")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in NAMES:
        raise FormatError(
            f"{file}: tensor {name} has dtype {dtype!r}, which autotp does not read (it reads "
            f"{', '.join(sorted(NAMES))})"
        )
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise FormatError(f"{file}: tensor {name} has shape {shape!r}, not a list of non-negative integers")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise FormatError(f"{file}: tensor {name} has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    nbytes = math.prod(shape) * NAMES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise FormatError(
            f"{file}: tensor {name} of shape {tuple(shape)} and dtype {dtype} needs {nbytes} bytes, "
            f"its data_offsets {offsets} hold {offsets[1] - offsets[0]}"
        )


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
        raise FormatError(
            f"{f.name}: a tensor of shape {tuple(shape)} cannot be split into {partition.full_size} "
            f"rows along dim {dim}"
        )
    local = shape.copy()
    local[dim] = partition.local_size(rank)
    out = torch.empty(local, dtype=dtype)
    outer = torch.Size(shape[:dim]).numel()
    inner = torch.Size(shape[dim + 1 :]).numel() * dtype.itemsize  # bytes of one index along dim
    span = shape[dim] * inner  # bytes of one outer index
    out_rows = out.view(outer, local[dim], -1) if out.numel() else out
    if dim == 0:  # every run is one contiguous range of the file
        offset = 0
        for start, length in partition.runs[rank]:
            _read_into(f, begin + start * inner, out_rows[0, offset : offset + length])
            offset += length
        return out
    step = max(1, _CHUNK_BYTES // max(span, 1))
    for first in range(0, outer, step):
        count = min(step, outer - first)
        chunk = _read_into(
            f, begin + first * span, torch.empty((count, shape[dim], inner // dtype.itemsize), dtype=dtype)
        )
        offset = 0
        for start, length in partition.runs[rank]:
            out_rows[first : first + count, offset : offset + length] = chunk[:, start : start + length]
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
