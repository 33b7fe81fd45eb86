"""Commands given what a careless user or an attacker gives them: a timm config.json of the
wrong shape to `vit-hub import`, class names that repeat, and two `vit-hub train` runs into one
--out at once. Each is refused in one line, and nothing is written."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import timm

from conftest import TINY_TRAIN_FLAGS, assert_one_line
from vit_hub.cli import main
from vit_hub.hub.key_mapping import distinct
from vit_hub.model.config import ViTConfig
from vit_hub.model.fields import ConfigError
from vit_hub.train.settings import OUT_LOCK, TrainingError, holding_out


def run_vit_hub(*argv) -> tuple[int, str]:
    """`vit-hub ARGV` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, err.getvalue()


# vit-hub import ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def timm_source(tmp_path_factory) -> Path:
    """A tiny timm ViT as timm saves it for the Hub (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("timm_source")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, num_classes=2)
    timm.models.save_for_hf(model, folder, safe_serialization=True)
    return folder


def edited(source: Path, folder: Path, edit) -> Path:
    """A copy of the timm source whose config.json went through `edit(config)`."""
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def set_in(path: str, value):
    """An edit that sets config[a][b]... for the path 'a.b...' (made where missing)."""
    def edit(config: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            config = config.setdefault(key, {})
        config[last] = value
    return edit


def drop_img_size(edit):
    """`edit`, with model_args' img_size removed, so that pretrained_cfg.input_size is read."""
    def both(config: dict) -> None:
        (config.get("model_args") or {}).pop("img_size", None)
        edit(config)
    return both


MALFORMED_TIMM = {  # config.json edit -> what the one line says
    "input_size of length 5": (drop_img_size(set_in("pretrained_cfg.input_size", [3, 32, 32, 1, 1])),
                               "expected pretrained_cfg.input_size as [channels, height, width], found"),
    "input_size of strings": (drop_img_size(set_in("pretrained_cfg.input_size", [3, "a", "b"])),
                              "expected pretrained_cfg.input_size as a side or [height, width]"),
    "model_args a string": (set_in("model_args", "evil"), "expected model_args in config.json as an object, found str"),
    "pretrained_cfg a list": (set_in("pretrained_cfg", [1, 2]),
                              "expected pretrained_cfg in config.json as an object, found list"),
    "num_heads a string": (set_in("model_args.num_heads", "evil"),
                           "expected model_args.num_heads as a whole number, found 'evil'"),
    "img_size a dict": (set_in("model_args.img_size", {"h": 1}), "expected model_args.img_size as a side or"),
}


@pytest.mark.parametrize("case", MALFORMED_TIMM)
def test_a_timm_config_of_the_wrong_shape_is_refused_in_one_line(timm_source, tmp_path, case):
    edit, fragment = MALFORMED_TIMM[case]
    source = edited(timm_source, tmp_path / "source", edit)
    code, stderr = run_vit_hub("import", source, "--out", tmp_path / "out")
    assert code == 2, stderr
    assert fragment in assert_one_line(stderr.removeprefix("error: "))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit", [set_in("label_names", 7), set_in("pretrained_cfg.crop_pct", "wide")],
                         ids=["label_names a number", "crop_pct a string"])
def test_timm_entries_the_import_only_reads_for_text_are_ignored_when_malformed(timm_source, tmp_path, edit):
    source = edited(timm_source, tmp_path / "source", edit)
    code, stderr = run_vit_hub("import", source, "--out", tmp_path / "out")
    assert code == 0, stderr
    assert ViTConfig.from_json(tmp_path / "out" / "config.json").labels == ["0", "1"]


# Class names ------------------------------------------------------------------------------------
def test_labels_that_repeat_are_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        ViTConfig(labels=["x"] * 10)
    assert_one_line(str(refused.value), "labels: expected a different name for each class, found ['x']")
    with pytest.raises(ConfigError, match=r"found \['cat', 'dog'\] more than once"):
        ViTConfig(labels=["dog", "cat", "dog", "bird", "cat"])


def test_imported_names_that_repeat_get_their_class_index():
    """transformers' ImageNet ViTs name two classes "crane": both stay, told apart."""
    assert distinct(["crane", "heron", "crane"]) == ["crane (0)", "heron", "crane (2)"]
    assert distinct(["a", "b"]) == ["a", "b"]


# Two runs into one --out ---------------------------------------------------------------------------
def test_a_second_run_into_an_out_being_written_is_refused_naming_the_first(image_folder, tmp_path):
    """The first run holds --out (holding_out, as `vit-hub train` takes it); the second, started
    while it runs, says in one line which process holds it and writes nothing."""
    out = tmp_path / "out"
    with holding_out(out):
        code, stderr = run_vit_hub("train", "--data", image_folder, "--out", out, "--epochs", "1", *TINY_TRAIN_FLAGS)
        assert code == 2
        assert_one_line(stderr.removeprefix("error: "), f"--out {out}: expected a folder no other run is writing, "
                                                        f"found it held by process {os.getpid()}")
        assert sorted(path.name for path in out.iterdir()) == [OUT_LOCK]
    assert not out.exists()  # made for the lock, left empty: removed

    code, stderr = run_vit_hub("train", "--data", image_folder, "--out", out, "--epochs", "1", *TINY_TRAIN_FLAGS)
    assert code == 0, stderr
    assert (out / "model.safetensors").is_file() and not (out / OUT_LOCK).exists()


def test_a_lock_that_is_a_link_is_refused_and_the_file_it_points_to_kept(image_folder, tmp_path):
    """A link at --out/.vit-hub-train.lock is not followed: the file it points to keeps its bytes."""
    out, precious = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    precious.write_text("a person's notes\n")
    (out / OUT_LOCK).symlink_to(precious)
    code, stderr = run_vit_hub("train", "--data", image_folder, "--out", out, "--epochs", "1", *TINY_TRAIN_FLAGS)
    assert code == 2
    assert_one_line(stderr.removeprefix("error: "), f"--out {out}: expected {OUT_LOCK} in it to be a regular file, "
                                                    f"found a link")
    assert precious.read_text() == "a person's notes\n" and (out / OUT_LOCK).is_symlink()


def test_a_lock_that_is_a_fifo_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / OUT_LOCK)
    with pytest.raises(TrainingError) as refused:
        with holding_out(out):
            pass
    assert_one_line(str(refused.value), f"expected {OUT_LOCK} in it to be a regular file, found a FIFO")


def test_the_holder_named_in_a_refusal_is_printed_escaped(tmp_path):
    """The lock's line is text any process could have written: a newline or a terminal escape
    in it is shown as its escape, and cannot forge a line of its own."""
    out = tmp_path / "out"
    with holding_out(out):
        (out / OUT_LOCK).write_text("process 1\nerror: forged line\x1b[2K")
        with pytest.raises(TrainingError) as refused:
            with holding_out(out):
                pass
    message = assert_one_line(str(refused.value), r"held by process 1\nerror: forged line\x1b[2K; wait")
    assert "\x1b" not in message


@pytest.mark.parametrize("meanwhile", ["removed", "made anew"])
def test_a_lock_released_just_as_this_run_opened_it_is_refused(tmp_path, monkeypatch, meanwhile):
    """The run holding --out removes its lock file before it unlocks it; a run that opened the file
    just before then locks a file no other run can find (removed, or replaced by a later run's):
    it is refused in one line, its block never runs, and the folder stays."""
    from vit_hub.train import settings

    out = tmp_path / "out"
    out.mkdir()
    open_lock = settings._open_lock

    def opened_then_released(lock: Path, folder: Path) -> int:
        descriptor = open_lock(lock, folder)
        lock.unlink()  # the holder finishes
        if meanwhile == "made anew":
            lock.write_text("process 2 (a run started after it)")
        return descriptor

    monkeypatch.setattr(settings, "_open_lock", opened_then_released)
    ran = []
    with pytest.raises(TrainingError) as refused:
        with holding_out(out):
            ran.append(True)
    assert_one_line(str(refused.value), f"--out {out}: expected a folder no other run is writing, found one that "
                                        f"was just released; start the run again")
    assert not ran and out.is_dir()


def test_an_out_the_run_did_not_make_is_kept_even_when_it_is_left_empty(tmp_path):
    """holding_out removes only a folder it made and left empty: a person's --out stays, whether it
    was empty already or the run emptied it (--overwrite removing what was there)."""
    out = tmp_path / "out"
    out.mkdir()
    with holding_out(out):
        pass
    assert out.is_dir() and list(out.iterdir()) == []
    (out / "model.safetensors").write_bytes(b"an earlier run's weights")
    with holding_out(out):
        (out / "model.safetensors").unlink()
    assert out.is_dir() and list(out.iterdir()) == []
    with holding_out(tmp_path / "new"):
        pass
    assert not (tmp_path / "new").exists()  # made for the lock, left empty: removed
