"""Training on folders nobody checked, and runs that are killed.

A data folder may hold links (to `..`, to another class, to a folder outside it); `--out` may
point inside `--data`; `--resume` may be given flags that would change the run; and a run may
be SIGKILLed at any moment, in the middle of writing its checkpoint too. Each case asserts
a bounded listing, one-line refusals that leave everything as it was, or a resumed run whose
result is bit for bit the one of a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_bad_input import listing, run_vit_hub

from conftest import CLASSES, TINY_TRAIN_FLAGS, assert_one_line, read_json, write_class_folders
from vit_hub.data import sources as vdata
from vit_hub.data.sources import DataError
from vit_hub.layout import ModelDir
from vit_hub.train.checkpoint import read_checkpoint_state
from vit_hub.train.run import train
from vit_hub.train.settings import TrainingError, TrainSettings

CHECKPOINT = ModelDir.checkpoint

REPO = Path(__file__).resolve().parents[1]
PER_CLASS = 6


def class_folders(root: Path) -> Path:
    write_class_folders(root, per_class=PER_CLASS, seed=0)
    return root


def real_class(path: str) -> str:
    """The class folder an image really lives in (`write_class_folders` names them), whatever
    links led to it."""
    return next(part for part in reversed(Path(os.path.realpath(path)).parent.parts) if part in CLASSES)


def assert_each_image_once_under_its_own_class(samples: list[tuple[str, int]], classes: list[str]) -> None:
    real_paths = [os.path.realpath(path) for path, _ in samples]
    assert len(real_paths) == len(set(real_paths)), "an image is listed twice"
    assert [real_class(path) for path, _ in samples] == [classes[label] for _, label in samples]


# Links in a data folder --------------------------------------------------------------------
LIST_IN_A_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from vit_hub.data.sources import index_image_folder

    # The listing may use 256 MB more than the interpreter already holds, then MemoryError.
    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 2**20, resource.RLIM_INFINITY))
    def peak_kb():  # VmHWM, not ru_maxrss: a child forked from pytest inherits its maxrss
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))

    before = peak_kb()
    started = time.monotonic()
    index = index_image_folder(Path(sys.argv[1]))
    print(json.dumps(dict(parts=index.parts, classes=index.classes, seconds=time.monotonic() - started,
                          grew_kb=peak_kb() - before)))
""")


def test_two_links_to_the_parent_folder_list_each_image_once_in_bounded_time_and_memory(tmp_path):
    """Two links to `..` make the tree infinite when links are followed blindly. Listed in a
    child process under a memory limit and a timeout, so a regression fails instead of taking
    the machine down."""
    root = class_folders(tmp_path / "data")
    for name in ("up", "again"):
        (root / "bright_disc" / name).symlink_to("..")
    (root / "dark_square" / "up").symlink_to("..")
    result = subprocess.run([sys.executable, "-c", LIST_IN_A_CHILD, str(root)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    listed = json.loads(result.stdout)
    samples = [tuple(sample) for sample in listed["parts"]["train"]]
    assert len(samples) == 2 * PER_CLASS
    assert_each_image_once_under_its_own_class(samples, listed["classes"])
    assert listed["seconds"] < 5 and listed["grew_kb"] < 20 * 1024


def test_one_link_to_the_parent_folder_neither_multiplies_nor_mislabels_nor_leaks_into_validation(tmp_path):
    """A link to `..` inside a class folder reaches every image again: each must be listed once,
    under its own class, and never on both sides of the validation split."""
    root = class_folders(tmp_path / "data")
    (root / "bright_disc" / "up").symlink_to("..")
    splits = vdata.load_splits(str(root), val_split=0.25, seed=0)
    assert len(splits.train) + len(splits.val) == 2 * PER_CLASS
    folder = splits.train.dataset
    assert_each_image_once_under_its_own_class(folder.samples, splits.labels)
    train_files = {os.path.realpath(folder.samples[i][0]) for i in splits.train.indices}
    val_files = {os.path.realpath(folder.samples[i][0]) for i in splits.val.indices}
    assert not train_files & val_files


def test_a_link_into_another_class_never_labels_its_images_as_this_class(tmp_path):
    root = class_folders(tmp_path / "data")
    theirs = root / "dark_square"
    write_class_folders(tmp_path / "more", per_class=2, seed=1)
    (theirs / "sub").mkdir()
    for image in sorted((tmp_path / "more" / "dark_square").iterdir()):
        image.rename(theirs / "sub" / image.name)
    mine = root / "bright_disc"
    (mine / "whole").symlink_to("../dark_square")  # the other class's folder
    (mine / "part").symlink_to("../dark_square/sub")  # a folder inside it
    stolen = sorted(theirs.glob("*.png"))[0]
    (mine / "stolen.png").symlink_to(stolen)  # one of its files
    index = vdata.index_image_folder(root)
    samples = index.parts["train"]
    assert_each_image_once_under_its_own_class(samples, index.classes)
    assert [label for _, label in samples].count(1) == PER_CLASS + 2  # dark_square keeps all of its own
    assert len(samples) == 2 * PER_CLASS + 2


def test_folders_linked_from_outside_are_listed_once_under_the_class_that_links_them(tmp_path):
    """Links to data elsewhere are ordinary (a class folder on another disk): followed, once."""
    root = class_folders(tmp_path / "data")
    elsewhere = write_class_folders(tmp_path / "elsewhere", per_class=3, seed=2)
    outside = tmp_path / "elsewhere" / "bright_disc"
    mine = root / "bright_disc"
    (mine / "more").symlink_to(outside)
    (mine / "more_again").symlink_to(outside)  # the same folder a second time
    (mine / "one.png").symlink_to(elsewhere[0])  # a file inside it, a third time
    (mine / "loop").symlink_to(mine / "loop")  # a link to itself: skipped
    index = vdata.index_image_folder(root)
    samples = index.parts["train"]
    assert_each_image_once_under_its_own_class(samples, index.classes)
    assert len(samples) == 2 * PER_CLASS + 3
    through = [path for path, _ in samples if Path(os.path.realpath(path)).is_relative_to(outside)]
    assert len(through) == 3 and all(path.startswith(str(mine / "more") + os.sep) for path in through)  # the first link


def test_a_class_folder_that_links_to_data_elsewhere_is_a_class(tmp_path):
    root = class_folders(tmp_path / "data")
    write_class_folders(tmp_path / "elsewhere", per_class=3, seed=2)
    (root / "linked").symlink_to(tmp_path / "elsewhere" / "bright_disc")
    index = vdata.index_image_folder(root)
    assert index.classes == ["bright_disc", "dark_square", "linked"]
    assert [label for _, label in index.parts["train"]].count(2) == 3


@pytest.mark.parametrize("make, fragments", [
    (lambda root: (root / "copy").symlink_to(root / "bright_disc"),
     ["copy", "is the same folder as", "bright_disc"]),
    (lambda root: (root / "all").symlink_to(root),
     ["all", "is the same folder as"]),
    (lambda root: (root / "above").symlink_to(root.parent),
     ["above", "holds the data folder itself"]),
], ids=["two classes, one folder", "a class that is the data folder", "a class above the data folder"])
def test_class_folders_that_are_not_folders_of_their_own_are_refused_in_one_line(tmp_path, make, fragments):
    root = class_folders(tmp_path / "data")
    make(root)
    with pytest.raises(DataError) as error:
        vdata.index_image_folder(root)
    assert_one_line(str(error.value), *fragments)


def test_a_test_class_that_links_to_the_training_class_is_refused(tmp_path):
    """Otherwise the test split would be the training images again."""
    write_class_folders(tmp_path / "train", per_class=2, seed=0)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "bright_disc").symlink_to("../train/bright_disc")
    with pytest.raises(DataError) as error:
        vdata.index_image_folder(tmp_path)
    assert_one_line(str(error.value), str(tmp_path / "test" / "bright_disc"), "is the same folder as",
                    str(tmp_path / "train" / "bright_disc"))


# --out inside --data ---------------------------------------------------------------------------
@pytest.mark.parametrize("out", ["data/results", "data", "data/bright_disc", "link/results"],
                         ids=["inside", "the folder itself", "a class folder", "inside, through a link"])
def test_out_inside_data_is_refused_in_one_line_before_anything_is_written(tmp_path, out):
    """Accepted, the next run on the folder would read the model's plots as a class `results`."""
    root = class_folders(tmp_path / "data")
    (tmp_path / "link").symlink_to(root)
    before = listing(tmp_path)
    code, stderr = run_vit_hub("train", "--data", root, "--out", tmp_path / out, "--epochs", "1",
                               *TINY_TRAIN_FLAGS)
    assert code == 2
    assert_one_line(stderr, f"--out {tmp_path / out}", f"outside --data {root}")
    assert listing(tmp_path) == before


def test_a_sweep_out_inside_data_is_refused_before_its_folder_is_made(tmp_path):
    from vit_hub.train.sweep import sweep

    root = class_folders(tmp_path / "data")
    with pytest.raises(TrainingError) as error:
        sweep(TrainSettings(data=str(root), out=str(root / "sweeps"), epochs=1), [("depth", [1, 2])],
              root / "sweeps")
    assert_one_line(str(error.value), "--out", "outside --data")
    assert not (root / "sweeps").exists()


def test_out_inside_data_is_refused_through_the_python_api_too(tmp_path):
    root = class_folders(tmp_path / "data")
    with pytest.raises(TrainingError) as error:
        train(TrainSettings(data=str(root), out=str(root / "results"), epochs=1))
    assert_one_line(str(error.value), "--out", "outside --data")
    assert not (root / "results").exists()


def test_out_beside_data_with_a_similar_name_is_accepted(tmp_path):
    """`data-results` starts like `data` but is not inside it."""
    root = class_folders(tmp_path / "data")
    code, stderr = run_vit_hub("train", "--data", root, "--out", tmp_path / "data-results", "--epochs", "1",
                               *TINY_TRAIN_FLAGS)
    assert code == 0, stderr


# --resume with flags that would change the run ---------------------------------------------------
@pytest.fixture(scope="module")
def paused_run(tmp_path_factory) -> dict[str, Path]:
    """One epoch of a two-epoch tiny run, paused with a resumable checkpoint."""
    base = tmp_path_factory.mktemp("paused")
    data = class_folders(base / "data")
    out = base / "run"
    code, stderr = run_vit_hub("train", "--data", data, "--out", out, "--epochs", "2", "--stop-after-epochs", "1",
                               *TINY_TRAIN_FLAGS)
    assert code == 0, stderr
    return dict(data=data, out=out)


@pytest.fixture
def paused(paused_run, tmp_path) -> dict[str, Path]:
    """A copy of the paused run that a test may continue."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(paused_run["out"], out)
    return dict(data=paused_run["data"], out=out)


def test_resume_refuses_flags_that_would_change_the_run_naming_each(paused, tmp_path):
    """Flags that would change a resumed run are refused, not silently ignored."""
    other = class_folders(tmp_path / "other")
    before = listing(paused["out"])
    code, stderr = run_vit_hub("train", "--resume", "--out", paused["out"], "--epochs", "5", "--embed-dim", "32",
                               "--data", other, "--seed", "0", "--image-size", "16")
    assert code == 2
    line = assert_one_line(stderr, "--resume", "--epochs 5 (the checkpoint's: 2)",
                           "--embed-dim 32 (the checkpoint's: 16)", f"--data {other} (the checkpoint's: {paused['data']})")
    assert "--seed" not in line and "--image-size" not in line  # the same as the checkpoint's
    assert listing(paused["out"]) == before


def test_resume_refuses_a_changed_setting_through_the_python_api_too(paused):
    with pytest.raises(TrainingError) as error:
        train(TrainSettings(data="", out=str(paused["out"])), resume=True,
              resume_flags={"lr": 0.1, "model": {"depth": 3}})
    assert_one_line(str(error.value), "--lr 0.1", "--depth 3")


def test_resume_accepts_the_checkpoint_s_own_values_and_applies_how_to_run_flags(paused):
    """Flags equal to the checkpoint's are fine, however spelled (16 for 16x16, the data folder's
    path through a link); --workers, --device, --compile and --strict say how to run, not what."""
    link = paused["out"].parent / "same-data"
    link.symlink_to(paused["data"])
    code, stderr = run_vit_hub("train", "--resume", "--out", paused["out"], "--epochs", "2", "--image-size", "16x16",
                               "--embed-dim", "16", "--data", link, "--lr", "3e-3", "--workers", "1", "--strict")
    assert code == 0, stderr
    settings = read_json(paused["out"] / "metrics.json")["settings"]
    assert settings["num_workers"] == 1 and settings["strict"] is True
    assert settings["data"] == str(paused["data"])  # the run's own spelling is kept


# A training run SIGKILLed anywhere resumes to the same result -------------------------------------
# sitecustomize of the killed `vit-hub train` processes: at the point named by KILL_AT the run
# writes KILL_MARK and sleeps, and the test kills it there. The weights and checkpoint writes
# are paused half-way through the file, as a kill in the middle of the write leaves it.
PAUSE_AT_A_POINT = textwrap.dedent('''
    import os, time
    from pathlib import Path

    import safetensors.torch

    POINT, MARK = os.environ.get("KILL_AT", ""), os.environ.get("KILL_MARK", "")


    def pause():
        Path(MARK).write_text(POINT)
        time.sleep(600)


    def half_a_file_then_pause(write):
        def paused(tensors, filename, metadata=None):
            name = Path(filename).name
            if (POINT == "checkpoint" and name.startswith(ModelDir.checkpoint)) or \\
                    (POINT == "weights" and name.startswith(ModelDir.weights)):
                data = safetensors.torch.save(tensors, metadata=metadata)
                with open(filename, "wb") as handle:
                    handle.write(data[:len(data) // 2])
                pause()
            return write(tensors, filename, metadata=metadata)
        return paused


    def pause_before(function, times=lambda *args: True):
        def paused(*args, **kwargs):
            if times(*args):
                pause()
            return function(*args, **kwargs)
        return paused


    # the checkpoint and the best weights (vit_hub.train.checkpoint; the weights through save_model)
    # are written by safetensors' save_file: patched before vit_hub imports it
    safetensors.torch.save_file = half_a_file_then_pause(safetensors.torch.save_file)
    from vit_hub.train import report as run_report  # noqa: E402
    from vit_hub.train import schedule
    from vit_hub.train import loop as train
    from vit_hub.layout import ModelDir  # noqa: E402

    steps = []


    def in_the_second_epoch(plan, *args):
        steps.append(1)
        return len(steps) == plan.steps_per_epoch + 2


    if POINT == "step":  # the second step of the second epoch this process trains (its rate is read first)
        schedule.Schedule.lr_at = pause_before(schedule.Schedule.lr_at, in_the_second_epoch)
    elif POINT == "metrics":  # after an epoch's checkpoint, before its metrics.json
        train.Trainer._write_metrics = pause_before(train.Trainer._write_metrics)
    elif POINT == "finish":  # every epoch trained and saved, the plots and card not yet drawn
        run_report.plot_curves = pause_before(run_report.plot_curves)
''')
VIT_HUB = Path(sys.executable).with_name("vit-hub")


def run_vit_hub_process(hooks: Path, argv: list, log: Path, kill_at: str = "") -> None:
    """A real `vit-hub ARGV` process with the pause hooks: SIGKILLed once it pauses at `kill_at`,
    or run to the end (exit 0) without one. Fails if it ends before the point, or errs."""
    mark = log.with_suffix(".paused")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
           "KILL_AT": kill_at, "KILL_MARK": str(mark), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as output:
        process = subprocess.Popen([VIT_HUB, *map(str, argv)], env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while kill_at and not mark.exists():
            assert process.poll() is None, f"the run ended before reaching {kill_at}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the run did not reach {kill_at} in 300 s"
            time.sleep(0.05)
        if not kill_at:
            assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        process.kill()  # SIGKILL: nothing of the run's own clean-up runs
        process.wait(timeout=60)


def epochs_checkpointed(out: Path) -> int:
    return read_checkpoint_state(out)["epoch"]


def without_timing(history: list[dict]) -> list[dict]:
    timing = ("images_per_second", "epoch_seconds", "model_tflop_s", "mfu")
    return [{key: value for key, value in record.items() if key not in timing} for record in history]


@pytest.mark.slow
def test_a_run_sigkilled_at_five_points_resumes_to_the_bit_identical_result(split_image_folder, tmp_path):
    """Killed inside the best weights' write, in a training step, inside the checkpoint's
    write (half the file written: a checkpoint written in place is lost there), between the
    checkpoint and metrics.json, and while drawing the plots at the end; resumed after each.
    Every source of randomness is on: augmentation, dropout, stochastic depth, shuffling."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PAUSE_AT_A_POINT)
    flags = ["--data", split_image_folder, "--epochs", "3", *TINY_TRAIN_FLAGS, "--augment", "photos",
             "--dropout", "0.1", "--drop-path", "0.1"]
    straight, out = tmp_path / "straight", tmp_path / "killed"
    run_vit_hub_process(hooks, ["train", "--out", straight, *flags], tmp_path / "straight.log")

    resume = ["train", "--resume", "--out", out]
    run_vit_hub_process(hooks, ["train", "--out", out, *flags], tmp_path / "1.log", kill_at="weights")
    assert epochs_checkpointed(out) == 0  # epoch 1's best weights were being written
    run_vit_hub_process(hooks, resume, tmp_path / "2.log", kill_at="step")
    assert epochs_checkpointed(out) == 1
    run_vit_hub_process(hooks, resume, tmp_path / "3.log", kill_at="checkpoint")
    assert epochs_checkpointed(out) == 1  # epoch 2's checkpoint was half written: epoch 1's is whole
    run_vit_hub_process(hooks, resume, tmp_path / "4.log", kill_at="metrics")
    assert epochs_checkpointed(out) == 2
    run_vit_hub_process(hooks, resume, tmp_path / "5.log", kill_at="finish")
    assert epochs_checkpointed(out) == 3
    run_vit_hub_process(hooks, resume, tmp_path / "6.log")

    for name in ("model.safetensors", CHECKPOINT):
        expected, resumed = load_file(str(straight / name)), load_file(str(out / name))
        assert expected.keys() == resumed.keys()
        assert all(expected[key].equal(resumed[key]) for key in expected), name
    expected_metrics, metrics = read_json(straight / "metrics.json"), read_json(out / "metrics.json")
    assert without_timing(metrics["history"]) == without_timing(expected_metrics["history"])
    assert metrics["final"] == expected_metrics["final"]
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in straight.iterdir())
