"""The folders beside a Space folder that `vit-hub space` writes and deletes, made safe to kill.

`space.write_folder` writes a Space beside `--out` (the staging folder, `.NAME.writing-*`) and
swaps it in; the folder it replaces is renamed to a backup (`NAME.replaced-DATE-TIME-*`) and,
when the new Space holds every file of it with the same bytes, renamed once more to
`.NAME.deleting-*` and deleted. A kill can stop any of these half-way, so each leftover says
which of its files vit-hub may delete, and the next run of the same `--out` finishes the job
(`finish_leftovers`) without ever deleting a person's file:

  - a staging folder holds a MARKER_FILE from its start, naming each file before it is
    written (`WRITING` for its hash: any bytes, a write may have been cut), then their
    hashes once all are written; a run holds it locked (`flock`) while writing, so another run
    never takes a live one for a leftover;
  - a `.deleting-*` folder is a backup whose every file the new Space held with the same bytes;
    of it, only files its MARKER_FILE lists with their hash are deleted.

Files a leftover holds that its marker does not list, or lists with other bytes (a person
wrote them there), are kept, and so is the folder that holds them. A staging folder with no
marker yet (a run killed the moment it made it) is left alone, and so is every backup kept
for a person (`NAME.replaced-*`): those are theirs to delete.

Every name derived from `--out`'s (staging, backup, deleting) is cut to fit the file system's
limit on a name (NAME_MAX, 255 bytes on Linux): a `--out` of up to that limit works, a longer
one is refused in one line (`check_name`).
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from vit_hub.errors import UserError

# In the Space folder: the sha256 of each file written, so a later `vit-hub space` replaces only a
# folder it wrote and nobody changed since (never one that merely holds a space.json).
MARKER_FILE = ".vit-hub-space"
MAX_MARKER_BYTES = 2**20
WRITING = "-"  # a staging marker's hash for a file named before it is written: any bytes are vit-hub's
DEFAULT_NAME_MAX = 255  # bytes in one name, where the file system does not say
RANDOM_CHARACTERS = 8  # tempfile.mkdtemp's random part of a name
STAGING, DELETING, REPLACED = ".writing-", ".deleting-", ".replaced-"


# Names -----------------------------------------------------------------------------------------
def name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return DEFAULT_NAME_MAX


def check_name(out: Path) -> None:
    """A one-line UserError for an `--out` whose name is longer than a folder name may be."""
    limit = name_max(out.parent if out.parent.is_dir() else Path("."))
    length = len(os.fsencode(out.name))
    if length > limit:
        raise UserError(f"--out: expected a folder name of at most {limit} bytes, got one of {length} "
                        f"({out.name[:40]}...)")


def sibling_prefix(out: Path, before: str, after: str) -> str:
    """`before` + `out`'s name + `after`, the name cut so that a folder named this plus
    mkdtemp's random characters fits NAME_MAX (cut on a character, never inside one)."""
    room = name_max(out.parent) - RANDOM_CHARACTERS - len(os.fsencode(before + after))
    name = os.fsencode(out.name)[:max(room, 1)].decode("utf-8", errors="ignore") or "space"
    return f"{before}{name}{after}"


def staging_prefix(out: Path) -> str:
    return sibling_prefix(out, ".", STAGING)


def deleting_prefix(out: Path) -> str:
    return sibling_prefix(out, ".", DELETING)


def backup_prefix(out: Path) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return sibling_prefix(out, "", f"{REPLACED}{stamp}-")


# A staging folder, held while it is written --------------------------------------------------
@contextlib.contextmanager
def held_staging(out: Path) -> Iterator[Path]:
    """A new staging folder beside `out`, locked while the block runs; removed after it unless
    it was renamed away (swapped in)."""
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(out), dir=out.parent))
    descriptor = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(descriptor)  # the lock goes with it


def intent_marker(names: list[str]) -> str:
    """A staging folder's first MARKER_FILE: every file it will hold, named before it is written."""
    return "".join(f"{WRITING}  {name}\n" for name in sorted(names))


# Swapping in, and deleting what was replaced -------------------------------------------------
def swap_in(new: Path, out: Path) -> Path | None:
    """Move the folder `new` to `out`, a sibling. A folder already at `out` is first renamed to a
    dated backup beside it, and deleted only when the new folder holds every file of it with the
    same bytes (renamed to `.NAME.deleting-*` first, so that a kill leaves a folder a later run
    finishes): a file a person added or edited is never lost, even one written between the check
    of `out` and this swap, or behind a MARKER_FILE a person re-hashed -> the folder kept, or None."""
    if not out.exists():
        os.rename(new, out)
        return None
    backup = Path(tempfile.mkdtemp(prefix=backup_prefix(out), dir=out.parent))
    os.rename(out, backup)  # onto the empty folder just made
    try:
        os.rename(new, out)
    except OSError:
        os.rename(backup, out)
        raise
    if not _holds_all_of(out, backup):
        return backup
    doomed = Path(tempfile.mkdtemp(prefix=deleting_prefix(out), dir=out.parent))
    os.rename(backup, doomed)
    return None if delete_own(doomed, partial=False) else doomed


def _holds_all_of(folder: Path, old: Path) -> bool:
    """Every file and folder of `old` is in `folder` too, each file a regular one with the same bytes."""
    for path in old.rglob("*"):
        twin = folder / path.relative_to(old)
        if path.is_dir() and not path.is_symlink():
            if not twin.is_dir() or twin.is_symlink():
                return False
        elif path.is_symlink() or twin.is_symlink() or not path.is_file() or not twin.is_file() \
                or not filecmp.cmp(path, twin, shallow=False):
            return False
    return True


def delete_own(folder: Path, partial: bool) -> bool:
    """Delete what of `folder` its MARKER_FILE lists with the same bytes (any bytes, with
    `partial`, for a name listed as WRITING), then the marker, then the folders left empty ->
    whether `folder` is gone. Anything else stays, and so does the marker beside it."""
    listed = _listed(folder / MARKER_FILE)
    kept = False
    for path in list(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if name == MARKER_FILE or (path.is_dir() and not path.is_symlink()):
            continue
        if _own(path, listed.get(name), partial):
            path.unlink(missing_ok=True)
        elif os.path.lexists(path):  # not deleted meanwhile by another run
            kept = True
    if kept:
        return False
    (folder / MARKER_FILE).unlink(missing_ok=True)
    return _remove_empty_folders(folder)


def _listed(marker: Path) -> dict[str, str]:
    """{path: sha256 or WRITING} of a marker; empty for none, a link or one too large to be ours."""
    if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > MAX_MARKER_BYTES:
        return {}
    lines = marker.read_text(encoding="utf-8", errors="replace").splitlines()
    return {name: digest for digest, _, name in (line.partition("  ") for line in lines)}


def _own(path: Path, digest: str | None, partial: bool) -> bool:
    """A regular file the marker lists: with its bytes, or as WRITING in a staging folder."""
    if digest is None or path.is_symlink() or not path.is_file():
        return False
    try:
        return (partial and digest == WRITING) or sha256(path) == digest
    except FileNotFoundError:  # deleted meanwhile by another run finishing the same folder
        return False


def _remove_empty_folders(folder: Path) -> bool:
    for path in sorted((path for path in folder.rglob("*") if path.is_dir() and not path.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):
            path.rmdir()
    try:
        folder.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


# What a killed run left ----------------------------------------------------------------------
def finish_leftovers(out: Path) -> None:
    """Finish deleting the folders a killed run of the same `out` left beside it (see the module
    docstring): `.deleting-*` folders, and staging folders no run holds. What they hold that
    vit-hub did not write stays, in them."""
    for path in sorted(out.parent.iterdir()):
        if path.is_symlink() or not path.is_dir():
            continue
        if path.name.startswith(deleting_prefix(out)):
            delete_own(path, partial=False)
        elif path.name.startswith(staging_prefix(out)):
            _finish_staging(path)


def _finish_staging(folder: Path) -> None:
    """Delete a staging folder a killed run left, unless a run holds it (a live one: left alone)
    or it has no marker yet (a run killed before it named anything: nothing in it is certain
    to be vit-hub's)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # gone meanwhile
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if (folder / MARKER_FILE).is_file():
            delete_own(folder, partial=True)
    except BlockingIOError:
        return
    finally:
        os.close(descriptor)
