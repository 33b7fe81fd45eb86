"""Model files on disk: safetensors checked before they are read, writes a kill cannot half-do.

Reading: `reading_safetensors(path)` wraps a safetensors read so that a file which is
missing its data, cut short, unreadable or not safetensors at all (a pickle renamed to
`model.safetensors`) fails with one line (a `UserError`) saying what was found. Nothing is
ever unpickled. `count_parameters` sizes a weights file from its header alone.

Reading a text file a model dir holds: `read_card` checks a README.md's size before it reads it
(a sparse file can claim gigabytes).

Writing: `replacing`, `write_text_atomically` and `replace_files` write beside the target,
flush it to disk and move it in with `os.replace`, so a crash or a kill leaves either the old
file or the new one (and so does a power cut, once the write has returned).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from safetensors import SafetensorError, safe_open

from vit_hub.errors import UserError

HEADER_LENGTH_BYTES = 8  # a safetensors file starts with its JSON header's length (u64, little-endian)
PICKLE_PROTOCOL_MARK = 0x80  # the first byte of a pickle of protocol 2 or later (torch.save's legacy format)
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format is a zip archive of pickles
MAX_CARD_BYTES = 4 * 2**20  # a model card is text: the Hub's own are kilobytes


def check_safetensors(path: str | Path) -> None:
    """A one-line UserError unless `path` can be read and starts like a safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            start = handle.read(HEADER_LENGTH_BYTES + 1)
            size = os.fstat(handle.fileno()).st_size
    except OSError as error:  # safetensors itself would call any of these "No such file or directory"
        raise UserError(f"expected a readable safetensors file at {path}, found one that cannot be "
                         f"opened ({error.strerror or type(error).__name__})") from None
    if not _looks_like_safetensors(start, size):
        raise UserError(f"expected a safetensors file at {path}, found {_what_it_is(start, size)}")


def _looks_like_safetensors(start: bytes, size: int) -> bool:
    """A header length that fits in the file, followed by the header's opening brace."""
    if len(start) <= HEADER_LENGTH_BYTES:
        return False
    header_length = struct.unpack("<Q", start[:HEADER_LENGTH_BYTES])[0]
    return header_length <= size - HEADER_LENGTH_BYTES and start[HEADER_LENGTH_BYTES:] == b"{"


def read_card(path: str | Path) -> str:
    """A README.md's text, its size checked before it is read: a one-line UserError for one over
    MAX_CARD_BYTES."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_CARD_BYTES + 1)
    if len(data) > MAX_CARD_BYTES:
        raise UserError(f"{path}: expected a model card of at most {MAX_CARD_BYTES // 2**20} MiB, found a larger one")
    return data.decode("utf-8", errors="replace")


def _what_it_is(start: bytes, size: int) -> str:
    """What a file that is not safetensors is instead, judged from its first bytes."""
    if start.startswith(ZIP_MAGIC):
        return "a zip archive (torch.save's format?), which vit_hub never loads"
    if start[:1] == bytes([PICKLE_PROTOCOL_MARK]):
        return "a Python pickle, which vit_hub never loads (unpickling can run code)"
    if len(start) <= HEADER_LENGTH_BYTES:
        return f"{size} bytes, too few for a safetensors header"
    return f"{size} bytes whose first ones are not a safetensors header (cut short, or another format)"


@contextlib.contextmanager
def reading_safetensors(path: str | Path) -> Iterator[None]:
    """Check `path` first, then turn safetensors' own errors inside the block into one line."""
    check_safetensors(path)
    try:
        yield
    except SafetensorError as error:
        raise UserError(f"expected a complete safetensors file at {path}, found a damaged one "
                         f"({error})") from None


def count_parameters(weights: Path) -> int | None:
    """How many numbers a safetensors weights file holds, from its header alone (None when
    there is no file): the model card's and `vit-hub sweep`'s parameter count."""
    if not weights.is_file():
        return None
    with safe_open(str(weights), framework="numpy") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write. When the block ends, the file is
    flushed to disk and moved onto `path`; a block that fails leaves `path` as it was and
    removes the temporary file.

        with replacing(ModelDir(out).checkpoint) as partial:
            save_file(tensors, str(partial))
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        yield partial
        _flush(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _flush_folder(path.parent)


def write_text_atomically(path: str | Path, text: str) -> None:
    """`path.write_text(text)`, but a kill leaves the old file or the new one, never half of it."""
    with replacing(path) as partial:
        partial.write_text(text)


def replace_files(staging: Path, target: Path, names: Iterable[str]) -> None:
    """Move each named file from `staging` into `target` (same file system), replacing any there;
    each is flushed to disk before it moves."""
    for name in names:
        _flush(staging / name)
        os.replace(staging / name, target / name)
    _flush_folder(target)


def _flush(path: Path) -> None:
    """fsync: the file's bytes reach the disk before a rename makes them the file's."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _flush_folder(folder: Path) -> None:
    """fsync a folder, so its renames reach the disk too (where the file system allows: some
    refuse to sync a folder, and by then the files are whole and in place)."""
    with contextlib.suppress(OSError):
        _flush(folder)
