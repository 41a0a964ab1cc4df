"""Reading the files of a weight update without trusting them (``/update_weights_from_disk``).

The request names a directory; what lies there is read only if it is a regular file inside it.
Handing each path to safetensors' ``load_file`` froze the whole server on a named pipe:
its open (which blocks on a FIFO until a writer comes) runs holding the interpreter lock, so
``/health`` went unanswered too. Here each file is checked with ``lstat`` (a regular file, or a
symlink resolving to one inside the directory; never a FIFO, socket or device, which are not
even opened), opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked again on the descriptor (a file
swapped after the check is caught), its size bounded, and read by ``readv`` calls, which release
the lock, checking a deadline between chunks. The caller runs this on a worker thread.

The tensors are parsed from the bytes here, as views of the buffer (no copy): the safetensors
layout is an 8-byte little-endian header length, a JSON header mapping each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data after the header;
``__metadata__`` is skipped), then the data. Every offset and size is checked against the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path

import torch

CHUNK_BYTES = 64 << 20  # one readv call: the deadline is checked between them
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header
CONFIG_BYTES = 16 << 20  # config.json is a few KiB
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _regular(path: Path, root: Path) -> Path:
    """``path`` (or, for a symlink, its target inside ``root``) once ``lstat`` shows a regular
    file; ValueError naming the file and what it is otherwise."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            target = Path(os.path.realpath(path))
            if not target.is_relative_to(root):
                raise ValueError(
                    f"{path.name}: a symlink leading outside {root} (to {target}); copy the file "
                    "into the directory"
                )
            path, mode = target, os.lstat(target).st_mode
    except OSError as e:
        raise ValueError(f"{path.name}: cannot stat it ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"{path.name}: {_kind(mode)}; only regular files are read, write the weights as such"
        )
    return path


def _read(path: Path, name: str, limit: int, deadline: float, timeout: float) -> bytearray:
    """The bytes of the regular file ``path`` (at most ``limit``), read before ``deadline``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{name}: cannot open it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the lstat and the open
            raise ValueError(f"{name}: {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{name}: grew to {st.st_size} bytes, past the {limit} left to read")
        buf = bytearray(st.st_size)
        view, got = memoryview(buf), 0
        while got < st.st_size:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"{name}: not read within {timeout} s (server.weight_read_timeout; "
                    f"{got} of {st.st_size} bytes); check the disk or raise the limit"
                )
            n = os.readv(fd, [view[got : got + CHUNK_BYTES]])
            if n == 0:
                raise ValueError(f"{name}: ended at byte {got} of {st.st_size} while read")
            got += n
        return buf
    except OSError as e:
        raise ValueError(f"{name}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)


def parse_safetensors(buf: bytearray, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, as views of ``buf``; ValueError naming the file
    and the first thing that does not fit."""
    if len(buf) < 8:
        raise ValueError(f"{name}: {len(buf)} bytes, too short for a safetensors header")
    n_header = int.from_bytes(buf[:8], "little")
    if n_header > min(MAX_HEADER_BYTES, len(buf) - 8):
        raise ValueError(f"{name}: header length {n_header} past the file's {len(buf)} bytes")
    try:
        header = json.loads(bytes(buf[8 : 8 + n_header]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the header is not a JSON object")
    start, out = 8 + n_header, {}
    for key, entry in header.items():
        if key != "__metadata__":
            out[key] = _tensor(buf, start, entry, f"{name}: {key}")
    return out


def _tensor(buf: bytearray, start: int, entry: object, where: str) -> torch.Tensor:
    """One header entry's tensor: a view of ``buf`` (a copy when the offset is misaligned)."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise ValueError(
            f"{where}: header entry {str(entry)[:200]} has no dtype of {sorted(DTYPES)}"
        )
    dtype = DTYPES[entry["dtype"]]
    try:
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: malformed header entry {str(entry)[:200]} ({e!r})") from None
    numel, size = math.prod(shape), torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(buf) - start:
        raise ValueError(f"{where}: shape {shape} or offsets [{begin}, {end}] out of range")
    if end - begin != numel * size:
        raise ValueError(f"{where}: {end - begin} bytes for shape {shape} of {entry['dtype']}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=start + begin).view(shape)
    return t if t.data_ptr() % size == 0 else t.clone()


def read_weight_dir(path: str | Path, limit: int, timeout: float) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of the HF model dir ``path`` (which must hold
    a ``config.json``), at most ``limit`` bytes of files in all, read within ``timeout`` seconds;
    ValueError naming the file and why otherwise (see the module docstring)."""
    deadline = time.monotonic() + timeout
    root = Path(os.path.realpath(path))
    if not root.is_dir():
        raise ValueError(f"{path}: not a directory; pass a Hugging Face model directory")
    if not os.path.lexists(root / "config.json"):
        raise ValueError(f"{path}: no config.json; pass a Hugging Face model directory")
    _read(_regular(root / "config.json", root), "config.json", CONFIG_BYTES, deadline, timeout)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files")
    checked = [_regular(f, root) for f in files]  # every file before the first read
    total = 0
    for f, target in zip(files, checked):
        total += target.stat().st_size
        if total > limit:
            raise ValueError(
                f"{f.name}: brings the weight files to {total} bytes, more than the {limit} this "
                "model's weights can take (16 bytes a parameter, plus headers); send this "
                "model's weights only"
            )
    params: dict[str, torch.Tensor] = {}
    left = limit
    for f, target in zip(files, checked):
        buf = _read(target, f.name, left, deadline, timeout)
        left -= len(buf)
        params.update(parse_safetensors(buf, f.name))
    return params
