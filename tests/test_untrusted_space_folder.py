"""`vit-hub space` against what a person or a kill leaves: a sample image that passes the header
check but does not decode, or holds no digit, is refused in one line naming it (not the graph);
an `--out` name up to the file system's limit works (the staging and backup names derived from
it are cut to fit) and a longer one is refused in one line; a run killed (SIGKILL) while it
deletes the folder it replaced, or while it writes the new one, leaves folders the next run of
the same `--out` deletes, keeping any file a person put in them."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from conftest import assert_one_line
from vit_hub.cli import main
from vit_hub.hub.space import MARKER_FILE
from vit_hub.hub.static_space import ORT_WEB_VERSION

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = ROOT / "models" / "vit-mnist"
SAMPLE = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
ORT_WEB = ROOT / ".venv" / "cache" / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"
SPACE = "me/vit-mnist-demo"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return shutil.copytree(BUNDLED_MODEL, tmp_path / "model")


def space(model: Path, out: Path, *flags: str) -> tuple[int, str]:
    """`vit-hub space MODEL --dry-run --out OUT [FLAGS]` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["space", str(model), "--repo-id", SPACE, "--dry-run", "--out", str(out), *flags])
    return code, err.getvalue()


STATIC = ("--static", "--onnxruntime-web", str(ORT_WEB))


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


# Samples -------------------------------------------------------------------------------------------
def cut_png(path: Path) -> None:
    """The sample digit without its last 30 bytes: the header reads, the pixels do not all decode."""
    path.write_bytes(SAMPLE.read_bytes()[:-30])


def blank_png(path: Path) -> None:
    Image.new("L", (28, 28), 0).save(path)


@pytest.mark.parametrize("flags", [STATIC, ()], ids=["static", "gradio"])
@pytest.mark.parametrize("make, found", [(cut_png, "found data that does not decode (image file is truncated)"),
                                         (blank_png, "found a blank image (no ink)")], ids=["cut", "blank"])
def test_a_sample_the_model_would_refuse_is_refused_in_one_line_naming_it(model_dir, tmp_path, make, found, flags):
    (model_dir / "samples").mkdir()
    shutil.copy(SAMPLE, model_dir / "samples" / "00_class7.png")
    make(model_dir / "samples" / "01_class1.png")
    code, stderr = space(model_dir, tmp_path / "space", *flags)
    assert code == 2
    line = assert_one_line(stderr, "samples/01_class1.png", found)
    assert "pipeline_map.onnx" not in line and not (tmp_path / "space").exists()


# Long names --------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [230, 250, 255])
def test_an_out_name_up_to_the_limit_is_written_and_replaced(model_dir, tmp_path, length):
    """The staging folder (`.NAME.writing-*`) and the backup (`NAME.replaced-DATE-TIME-*`) would
    be up to 34 bytes longer than NAME: their copies of it are cut to fit."""
    out = tmp_path / ("s" * length)
    assert space(model_dir, out, *STATIC) == (0, "")
    written = files_of(out)
    assert space(model_dir, out, *STATIC) == (0, "")  # replaced: through a backup beside it
    assert files_of(out) == written
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["model", out.name])


def test_an_out_name_over_the_limit_is_refused_in_one_line(model_dir, tmp_path):
    code, stderr = space(model_dir, tmp_path / ("s" * 256), *STATIC)
    assert code == 2
    assert_one_line(stderr, "--out: expected a folder name of at most 255 bytes, got one of 256")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


# Kills -------------------------------------------------------------------------------------------
# A child that runs `vit-hub space` and kills itself (SIGKILL: no finally, no cleanup) at a set
# point: the KILL_AT-th file deleted after the folder replaced was renamed aside ("delete"), or
# the KILL_AT-th file copied into the new Space ("write").
KILLING_CHILD = """
import os, shutil, signal, sys
point, kill_at = sys.argv[1], int(sys.argv[2])
real_rename, real_unlink, real_copy = os.rename, os.unlink, shutil.copyfile
state = {"aside": False, "count": 0}

def count_down():
    state["count"] += 1
    if state["count"] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def rename(source, target, *args, **kwargs):
    state["aside"] |= ".replaced-" in os.fspath(target)
    return real_rename(source, target, *args, **kwargs)

def unlink(path, *args, **kwargs):
    if point == "delete" and state["aside"]:
        count_down()
    return real_unlink(path, *args, **kwargs)

def copyfile(source, target, *args, **kwargs):
    if point == "write":
        count_down()
    return real_copy(source, target, *args, **kwargs)

os.rename, os.unlink, shutil.copyfile = rename, unlink, copyfile
from vit_hub.cli import main
sys.exit(main(sys.argv[3:]))
"""


def killed_space(model: Path, out: Path, point: str, kill_at: int) -> list[Path]:
    """`vit-hub space` killed at `point` -> the folders it left beside `out` and the model."""
    done = subprocess.run([sys.executable, "-c", KILLING_CHILD, point, str(kill_at), "space", str(model),
                           "--repo-id", SPACE, "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == -9, done.stderr[-2000:]
    return sorted(path for path in out.parent.iterdir() if path.name not in (out.name, model.name))


def test_a_run_killed_while_deleting_the_folder_it_replaced_is_finished_by_the_next(model_dir, tmp_path):
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    written = files_of(out)
    [left] = killed_space(model_dir, out, "delete", kill_at=5)
    assert 0 < len(files_of(left)) < len(written)  # half deleted
    assert space(model_dir, out)[0] == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "space"] and files_of(out) == written


def test_a_persons_file_in_a_half_deleted_folder_is_kept(model_dir, tmp_path):
    """Only the files the folder's marker lists with their bytes are deleted; a file a person
    wrote into it (a shell still inside the folder replaced) stays, and the folder with it."""
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    [left] = killed_space(model_dir, out, "delete", kill_at=5)
    (left / "notes.txt").write_text("mine")
    edited = next(path for path in sorted(left.rglob("*.py")))
    edited.write_text("edited by hand")
    assert space(model_dir, out)[0] == 0
    assert files_of(left) == {"notes.txt": b"mine", edited.relative_to(left).as_posix(): b"edited by hand",
                              MARKER_FILE: (left / MARKER_FILE).read_bytes()}


def test_a_run_killed_while_writing_the_new_space_is_cleaned_by_the_next(model_dir, tmp_path):
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    written = files_of(out)
    [left] = killed_space(model_dir, out, "write", kill_at=20)
    assert left.name.startswith(".space.writing-") and files_of(left)
    assert files_of(out) == written  # the Space in place is untouched
    assert space(model_dir, out)[0] == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "space"] and files_of(out) == written


def test_a_staging_folder_a_live_run_holds_is_left_alone(model_dir, tmp_path):
    """Another run's staging folder, locked while it is written, is not a leftover."""
    out = tmp_path / "space"
    live = tmp_path / ".space.writing-abcd1234"
    live.mkdir()
    (live / MARKER_FILE).write_text("-  app.py\n")
    (live / "app.py").write_text("being written")
    descriptor = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        assert space(model_dir, out)[0] == 0
    finally:
        os.close(descriptor)
    assert files_of(live) == {MARKER_FILE: b"-  app.py\n", "app.py": b"being written"}
    assert space(model_dir, out)[0] == 0 and not live.exists()  # no longer held: a leftover


def test_a_folder_named_like_a_leftover_without_a_marker_is_never_touched(model_dir, tmp_path):
    out = tmp_path / "space"
    mine = [tmp_path / ".space.writing-mine", tmp_path / ".space.deleting-mine"]
    for folder in mine:
        folder.mkdir()
        (folder / "thesis.tex").write_text("months of work")
    assert space(model_dir, out)[0] == 0
    assert all(files_of(folder) == {"thesis.tex": b"months of work"} for folder in mine)
