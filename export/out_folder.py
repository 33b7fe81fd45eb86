"""The export's `--out` folder: what an export may replace there, and how it moves its files in.

A person points `--out` at any folder, so the export treats it as theirs: it replaces or
removes a file only where it can show an export wrote it, and refuses the whole folder, in one
line and before any work, otherwise (`check_out_folder`):

  * a graph (`*.onnx` of the layout) is an export's when it carries the sha256 of the weights
    it came from (`graph_check.WEIGHTS_SHA256`), which every graph the export writes does;
  * the report is an export's when it is the JSON object the export writes (model, graphs);
  * config.json is an export's when it is a vit_hub config; in a folder that holds weights
    (a model dir), only when those weights are the ones being exported: another model's
    config.json is never replaced, or its weights would no longer load;
  * a link in place of any of these is nobody's to replace.

Graphs are written into a staging folder inside `--out` (`staging`, same file system, so
os.replace moves each in whole) and installed only when every check passed (`install`); a
failed export leaves the folder as it was, plus its report under a name no reader takes for a
finished export (`ExportLayout.failed_report`). A staging folder carries a marker with its
process id; leftovers of a killed export are removed by a later one only where that marker is
there and its process is gone, so a person's folder named `.export-notes` is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx

from vit_hub.errors import UserError
from vit_hub.layout import ExportLayout
from vit_hub.model.config import ViTConfig
from vit_hub.storage import write_text_atomically

from .graph_check import MAX_GRAPH_BYTES, WEIGHTS_SHA256, weights_sha256

STAGING_PREFIX = ".export-"  # the staging folder inside the output folder, while an export runs
STAGING_MARKER = ".vit_hub_export_staging"  # inside it: the process id of the export that made it
MAX_REPORT_BYTES = 64 * 2**20


class ForeignFileError(UserError):
    """`--out` holds a file the export would replace or remove and did not write."""


def check_out_folder(layout: ExportLayout, config: ViTConfig, weights: str | None) -> None:
    """Raise ForeignFileError unless every file the export may replace or remove in `layout`'s
    folder is shown to be an export's (see the module docstring). `weights` is the sha256 of
    the weights being exported (None: a model in memory, checked by its config alone)."""
    if layout.weights.is_file() and not layout.weights.is_symlink() and weights is not None \
            and weights_sha256(layout.weights) != weights:
        raise _foreign(layout, layout.weights.name, "another model's weights, whose config.json and graphs these "
                                                    "would replace")
    for path in (*layout.onnx_files, layout.int8, layout.config, layout.failed_report):
        if not os.path.lexists(path):
            continue
        if path.is_symlink() or not path.is_file():
            raise _foreign(layout, path.name, "a link or a folder, not a file an export wrote")
        if not _written_by_export(path, layout, config):
            raise _foreign(layout, path.name, "a file vit-hub export did not write")


def _foreign(layout: ExportLayout, name: str, what: str) -> ForeignFileError:
    return ForeignFileError(f"--out {layout.folder}: expected a new folder, the model's own or an earlier export of "
                            f"this model, found {name}: {what}; choose another --out, or move it away")


def _written_by_export(path: Path, layout: ExportLayout, config: ViTConfig) -> bool:
    if path.suffix == ".onnx":
        return _tied_graph(path)
    if path == layout.config:
        return _replaceable_config(path, layout, config)
    return _export_report(path)


def _tied_graph(path: Path) -> bool:
    """Whether `path` is an ONNX graph carrying the sha256 of the weights it came from."""
    if path.stat().st_size > MAX_GRAPH_BYTES:
        return False
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - protobuf raises many kinds on a file that is not a graph
        return False
    return any(entry.key == WEIGHTS_SHA256 for entry in model.metadata_props)


def _replaceable_config(path: Path, layout: ExportLayout, config: ViTConfig) -> bool:
    """A vit_hub config: in a model dir, only the exported model's own (its weights were
    checked in check_out_folder; its config, here, for a model in memory)."""
    try:
        found = ViTConfig.from_json(path)
    except (UserError, ValueError, TypeError):
        return False
    return found == config or not layout.weights.is_file()


def _export_report(path: Path) -> bool:
    if path.stat().st_size > MAX_REPORT_BYTES:
        return False
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(report, dict) and {"model", "graphs"} <= report.keys()


@contextlib.contextmanager
def staging(layout: ExportLayout) -> Iterator[ExportLayout]:
    """The same layout in a fresh folder inside the output folder, marked as the export's,
    removed afterwards whatever happens."""
    _remove_leftovers(layout.folder)
    folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=layout.folder))
    try:
        (folder / STAGING_MARKER).write_text(f"{os.getpid()}\n")
        yield ExportLayout(folder, layout.stem)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _remove_leftovers(folder: Path) -> None:
    """Staging folders of exports killed before they cleaned up: marked, their process gone (or
    killed between making the folder and marking it: an empty folder of mkdtemp's name)."""
    for leftover in folder.glob(f"{STAGING_PREFIX}*"):
        marker = leftover / STAGING_MARKER
        if leftover.is_symlink() or not leftover.is_dir():
            continue
        if marker.is_file() and not marker.is_symlink():
            if not _running(marker.read_text(errors="replace").strip()[:20]):
                shutil.rmtree(leftover, ignore_errors=True)
        elif re.fullmatch(rf"{re.escape(STAGING_PREFIX)}[a-z0-9_]{{8}}", leftover.name):
            with contextlib.suppress(OSError):
                leftover.rmdir()  # only where empty: nothing of anyone's is lost


def _running(pid: str) -> bool:
    """Whether a process with this id runs on this machine (the staging folder's owner)."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, OverflowError):  # gone, or an id no process can have
        return False
    except PermissionError:  # another user's process
        return True
    return True


def install(staged: ExportLayout, layout: ExportLayout, config: ViTConfig) -> None:
    """Move the staged files in, graphs first and the report last; remove what an earlier export
    wrote that this one did not (its graphs would pair with the new model), and an earlier
    failed report; config.json only where the one there differs (a model dir keeps its own)."""
    for path in (*layout.onnx_files, layout.int8):
        if path.suffix == ".onnx" and not (staged.folder / path.name).is_file():
            path.unlink(missing_ok=True)
    for graph in sorted(staged.folder.glob("*.onnx")):
        os.replace(graph, layout.folder / graph.name)
    write_config(config, layout.config)
    layout.failed_report.unlink(missing_ok=True)
    os.replace(staged.report, layout.report)


def keep_failed_report(staged: ExportLayout, layout: ExportLayout) -> None:
    """A failed export's report, under a name no reader takes for a finished export's."""
    os.replace(staged.report, layout.failed_report)


def write_config(config: ViTConfig, path: Path) -> None:
    """config.json beside the graphs; an equal one already there (the model dir) is left as is."""
    if path.is_file():
        try:
            if ViTConfig.from_json(path) == config:
                return
        except UserError:
            pass  # not a vit_hub config (a staging folder's): replace it
    write_text_atomically(path, json.dumps(config.to_dict(), indent=2) + "\n")
