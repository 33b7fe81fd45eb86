"""The export's --out folder is a person's folder: a file there is replaced or removed only where
an export wrote it, a failed export installs nothing, and killed exports' staging folders are
cleared without touching a person's folders of a similar name (export/out_folder.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line, tiny_config
from vit_hub.export import VerificationError, export_onnx
from vit_hub.export import out_folder
from vit_hub.hub.pretrained import HubVisionTransformer

REPO = Path(__file__).resolve().parents[1]


def tiny_model(seed: int = 0) -> HubVisionTransformer:
    torch.manual_seed(seed)
    return HubVisionTransformer(**tiny_config()).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    tiny_model().save_pretrained(folder)
    return folder


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` and its bytes (None for a folder)."""
    return {str(path.relative_to(folder)): (path.read_bytes() if path.is_file() else None)
            for path in sorted(folder.rglob("*"))}


def run_export(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vit_hub.export", *map(str, argv)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def test_a_folder_of_a_persons_files_is_refused_through_the_command_and_left_as_it_was(model_dir, tmp_path):
    """A folder of a person's files: their config.json, a model_int8.onnx of theirs, their folders
    .export-notes and .export-12345: one line, exit non-zero, every byte as it was."""
    person = tmp_path / "P"
    (person / ".export-notes").mkdir(parents=True)
    (person / ".export-notes" / "todo.txt").write_text("mine\n")
    (person / ".export-12345").mkdir()
    (person / "config.json").write_text('{"my": 1}\n')
    (person / "model_int8.onnx").write_text("mine\n")
    before = snapshot(person)
    result = run_export("--model", model_dir, "--out", person)
    assert result.returncode != 0
    assert_one_line(result.stderr, "did not write")
    assert snapshot(person) == before


@pytest.mark.parametrize("name, content", [
    ("config.json", '{"my": 1}\n'), ("model_int8.onnx", "mine\n"), ("pipeline_map.onnx", "mine\n"),
    ("model_export_report.json", '{"my": "notes"}\n')])
def test_each_file_an_export_did_not_write_is_refused(model_dir, tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(out_folder.ForeignFileError) as refused:
        export_onnx(model_dir, tmp_path)
    assert_one_line(str(refused.value), name)
    assert (tmp_path / name).read_text() == content and not (tmp_path / "model.onnx").exists()


def test_a_path_ending_in_onnx_guards_the_config_beside_it(model_dir, tmp_path):
    (tmp_path / "config.json").write_text('{"my": 1}\n')
    with pytest.raises(out_folder.ForeignFileError):
        export_onnx(model_dir, tmp_path / "x.onnx")
    assert (tmp_path / "config.json").read_text() == '{"my": 1}\n' and not (tmp_path / "x.onnx").exists()


def test_another_models_dir_is_refused_and_its_weights_still_load(model_dir, tmp_path):
    other = tmp_path / "other"
    HubVisionTransformer(**tiny_config(labels=["cat", "dog"])).save_pretrained(other)
    before = snapshot(other)
    with pytest.raises(out_folder.ForeignFileError) as refused:
        export_onnx(model_dir, other)
    assert_one_line(str(refused.value), "model.safetensors", "another model's weights")
    assert snapshot(other) == before
    HubVisionTransformer.from_pretrained(other)


def test_a_link_in_place_of_a_graph_is_refused_and_its_target_kept(model_dir, tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").symlink_to(target)
    with pytest.raises(out_folder.ForeignFileError):
        export_onnx(model_dir, out)
    assert target.read_text() == "mine\n" and (out / "model.onnx").is_symlink()


def test_a_dangling_link_as_out_is_one_line(model_dir, tmp_path):
    link = tmp_path / "gone"
    link.symlink_to(tmp_path / "nowhere")
    result = run_export("--model", model_dir, "--out", link)
    assert result.returncode != 0
    assert_one_line(result.stderr, "a link to nothing")


def test_an_earlier_export_of_the_model_and_its_own_dir_are_replaced(model_dir, tmp_path):
    """What an export wrote is its to replace: a second export into the same folder, and an
    export into the model dir itself (which keeps its config.json byte for byte)."""
    export_onnx(model_dir, tmp_path, output_attentions=True)
    export_onnx(model_dir, tmp_path)  # without attentions: the attentions graphs it wrote go
    assert (tmp_path / "model.onnx").is_file() and not (tmp_path / "pipeline_map.onnx").exists()
    own = tmp_path / "own"
    tiny_model().save_pretrained(own)
    config = (own / "config.json").read_bytes()
    export_onnx(own, own)
    assert (own / "config.json").read_bytes() == config and (own / "model.onnx").is_file()


def test_a_persons_folders_named_like_staging_survive_an_export(model_dir, tmp_path):
    for name in (".export-notes", ".export-12345", ".export-abcdefgh"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text("mine\n")
    export_onnx(model_dir, tmp_path)
    assert all((tmp_path / name / "keep.txt").read_text() == "mine\n"
               for name in (".export-notes", ".export-12345", ".export-abcdefgh"))


def test_a_killed_exports_marked_staging_folder_is_cleared(model_dir, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    leftover = tmp_path / ".export-x1y2z3w4"
    leftover.mkdir()
    (leftover / out_folder.STAGING_MARKER).write_text(f"{dead}\n")
    (leftover / "model.onnx").write_bytes(b"half a graph")
    unmarked_empty = tmp_path / ".export-q9r8s7t6"
    unmarked_empty.mkdir()
    export_onnx(model_dir, tmp_path)
    assert not leftover.exists() and not unmarked_empty.exists()


def test_a_failed_export_installs_nothing_and_keeps_its_report_aside(model_dir, tmp_path, monkeypatch):
    """A check that fails: a new folder gets only the failed report; a folder holding an earlier
    export keeps that export byte for byte."""
    earlier = tmp_path / "earlier"
    export_onnx(model_dir, earlier)
    before = snapshot(earlier)
    failing = lambda *args, **kwargs: {"failures": ["preprocess.onnx on image 0: planted"], "rows": []}  # noqa: E731
    monkeypatch.setattr("vit_hub.export.export_model.verify_preprocessing", failing)
    for out in (tmp_path / "new", earlier):
        with pytest.raises(VerificationError, match="nothing installed"):
            export_onnx(model_dir, out)
    assert sorted(path.name for path in (tmp_path / "new").iterdir()) == ["model_export_report.failed.json"]
    after = snapshot(earlier)
    assert {name: after[name] for name in before} == before
    assert set(after) - set(before) == {"model_export_report.failed.json"}
    assert json.loads((earlier / "model_export_report.failed.json").read_text())["preprocess"]["failures"]
    monkeypatch.undo()
    export_onnx(model_dir, earlier)  # the next good export clears the failed report
    assert not (earlier / "model_export_report.failed.json").exists()
