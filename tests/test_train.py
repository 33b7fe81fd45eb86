"""Training: a short run that learns, the model dir it writes, resume and Ctrl-C, and the
schedule, checkpoint and settings helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import TINY_MODEL, TINY_RUN, read_json, tiny_config, train_flags
from vit_hub import cli
from vit_hub.data import batches
from vit_hub.data import sources as vdata
from vit_hub.data.sources import config_for_data
from vit_hub.errors import DataError
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.layout import INSPECT_FIGURES, ModelDir
from vit_hub.model.config import DIGIT_LABELS, PRESETS, ViTConfig
from vit_hub.model.fields import ConfigError
from vit_hub.model.flops import TOTAL, count_flops, flop_rates, module_flops, peak_flops, training_flops
from vit_hub.model.vit import ViTOutput
from vit_hub.processing.preprocess import preprocess
from vit_hub.train import checkpoint
from vit_hub.train.checkpoint import load_checkpoint, read_checkpoint_state, save_checkpoint
from vit_hub.train.distributed import running
from vit_hub.train.evaluation import evaluate, shift_warning
from vit_hub.train.loop import Trainer
from vit_hub.train.run import build_trainer, train
from vit_hub.train.schedule import (SMALL_PHOTO_LEARNING_RATE, Schedule, default_batch_size, default_epochs,
                                    learning_rate, peak_learning_rate)
from vit_hub.train.settings import TrainingError, TrainSettings
from vit_hub.train.step import choose_compile, parameter_groups

CHECKPOINT = ModelDir.checkpoint

TIMING = ("images_per_second", "epoch_seconds", "model_tflop_s", "mfu")



def build_config(settings: TrainSettings, splits) -> ViTConfig:
    """The config a run with these settings trains (what build_trainer asks of the data)."""
    return config_for_data(splits, settings.preset, settings.model, settings.seed)

def tiny_settings(data, out, **overrides) -> TrainSettings:
    """A run of a few seconds: 16x16 inputs, one block of width 16, batches of 8, no workers."""
    values = dict(data=str(data), out=str(out), model=dict(TINY_MODEL), epochs=2, val_split=0.25, **TINY_RUN)
    values.update(overrides)
    return TrainSettings(**values)


def quietly(function, *args, **kwargs):
    """Call `function` with stdout and stderr captured; returns (result, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = function(*args, **kwargs)
    return result, out.getvalue(), err.getvalue()


def without_timing(history):
    return [{key: value for key, value in record.items() if key not in TIMING} for record in history]


def weights(path):
    return load_file(str(path))


def assert_same_tensors(first, second):
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


# A short run on the generated folder ------------------------------------------------------------
@pytest.fixture(scope="module")
def learned_run(image_folder, tmp_path_factory):
    """Five epochs on the two-class folder (with its corrupt file), photo augmentation on."""
    out = tmp_path_factory.mktemp("learned") / "model"
    settings = tiny_settings(image_folder, out, epochs=5, augment="photos",
                             command=f"vit-hub train --data {image_folder} --out {out}")
    metrics, stdout, stderr = quietly(train, settings)
    return dict(out=out, metrics=metrics, stdout=stdout, stderr=stderr, settings=settings)


def test_short_run_learns_the_easy_task_well_above_chance(learned_run):
    metrics = learned_run["metrics"]
    assert len(metrics["history"]) == 5
    assert metrics["final"]["split"] == "val" and metrics["final"]["n"] == 12
    assert metrics["final"]["accuracy"] >= 0.9  # chance is 0.5
    assert max(record["train_accuracy"] for record in metrics["history"]) >= 0.85  # under strong augmentation
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["train_loss"]
    assert metrics["best_val_accuracy"] == max(record["val_accuracy"] for record in metrics["history"])


def test_corrupt_file_is_reported_with_its_path_and_skipped(learned_run, corrupt_file):
    assert "skipped 1 unreadable image(s)" in learned_run["stderr"]
    assert str(corrupt_file) in learned_run["stderr"]
    assert "train 37 | val 12 | test 0 | 2 classes" in learned_run["stdout"]  # listed, then read


def test_run_writes_a_hub_layout_model_dir_without_pickles(learned_run):
    out = learned_run["out"]
    names = {path.name for path in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "metrics.json", "curves.png",
            "confusion_matrix.png", CHECKPOINT} <= names
    assert not [name for name in names if name.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt", ".partial"))]
    for image in ("curves.png", "confusion_matrix.png"):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_loop_writes_what_training_produces_and_the_run_adds_the_card_and_views(learned_run, split_image_folder,
                                                                                     tmp_path):
    """The loop alone (build_trainer + Trainer.run) leaves weights, config, metrics, plots and
    checkpoint, in save_pretrained's format; the card and the inspect views are the run level's."""
    with running("cpu") as runtime:
        quietly(build_trainer(tiny_settings(split_image_folder, tmp_path / "loop", epochs=1), runtime).run)
    loop = ModelDir(tmp_path / "loop")
    assert sorted(path.name for path in loop.folder.iterdir()) == sorted(
        [ModelDir.config, ModelDir.weights, ModelDir.metrics, ModelDir.curves, ModelDir.confusion_matrix, CHECKPOINT])
    resaved = tmp_path / "resaved"
    HubVisionTransformer.from_pretrained(str(loop.folder)).save_pretrained(resaved)
    for name in (ModelDir.config, ModelDir.weights):  # byte for byte what the Hub mixin writes
        assert (resaved / name).read_bytes() == (loop.folder / name).read_bytes(), name

    run = ModelDir(learned_run["out"])
    assert run.card.is_file() and run.inspect_report.is_file()
    assert all((run.folder / name).is_file() for name in INSPECT_FIGURES)
    kept = sorted(run.samples.glob("*.png"))  # validation images, both classes in turn: the app's examples
    assert [path.name for path in kept[:2]] == ["00_bright_disc.png", "01_dark_square.png"] and len(kept) <= 12


def test_the_loop_is_given_the_pretrained_weights_init_names(split_image_folder, tmp_path):
    with running("cpu") as runtime, pytest.raises(ValueError, match="--init some/vit as `start`"):
        build_trainer(tiny_settings(split_image_folder, tmp_path / "out", init="some/vit"), runtime)
    assert not (tmp_path / "out").exists()


def test_the_process_group_is_left_when_the_set_up_fails(split_image_folder, tmp_path, monkeypatch):
    """A set-up that fails after the runtime started (here: the data) still leaves the process
    group: under torchrun the other processes would otherwise wait on it."""
    from vit_hub.train import distributed, run

    left = []
    monkeypatch.setattr(distributed, "stop_runtime", left.append)

    def failing_set_up(*args, **kwargs):
        raise DataError("the data could not be read")

    monkeypatch.setattr(run, "build_trainer", failing_set_up)
    with pytest.raises(DataError, match="could not be read"):
        train(tiny_settings(split_image_folder, tmp_path / "out"))
    assert len(left) == 1 and left[0].device == torch.device("cpu")


def test_metrics_and_card_say_where_the_run_happened(learned_run):
    hardware = json.loads((learned_run["out"] / "metrics.json").read_text())["hardware"]
    assert hardware["device"].startswith("CPU") and hardware["processes"] == 1
    assert hardware["precision"] == "fp32" and hardware["torch"] == torch.__version__
    card = (learned_run["out"] / "README.md").read_text()
    assert f"trained on: {hardware['device']} x 1 process(es), fp32, torch {torch.__version__}" in card


def test_a_new_run_never_writes_over_a_trained_model(learned_run, image_folder, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(learned_run["out"], out)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    with pytest.raises(TrainingError, match=f"--out {out}: expected a new or empty folder, found a trained "
                                            r"model or run there \(checkpoint.safetensors, model.safetensors\); "
                                            "pass --resume to continue that run or --overwrite to replace it"):
        train(tiny_settings(image_folder, out, epochs=1))
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    metrics, _, _ = quietly(train, tiny_settings(image_folder, out, epochs=1), overwrite=True)
    assert len(metrics["history"]) == 1


@pytest.mark.parametrize("num_train, batch", [(60_000, 128), (1280, 128), (1279, 64), (360, 32), (108, 32),
                                              (40, 16), (9, 4)])
def test_small_data_gets_a_smaller_batch_for_about_ten_steps_an_epoch(num_train, batch):
    assert default_batch_size(num_train) == batch


@pytest.mark.parametrize("val, test, n, warned", [
    (0.95, 0.22, 100, True),  # like the stain-shifted cells (BENCHMARKS.md)
    (0.95, 0.93, 100, False),  # within noise
    (0.90, 0.80, 20, False),  # 10 points, but 20 test images cannot tell
    (0.99, 0.90, 1000, True),
])
def test_test_far_below_validation_is_reported(val, test, n, warned):
    evaluation = {"val": {"accuracy": val, "n": n}, "test": {"accuracy": test, "n": n}}
    warning = shift_warning(evaluation)
    assert (warning is not None) == warned
    if warned:
        assert f"test accuracy {test:.3f} is far below validation accuracy {val:.3f}" in warning


@pytest.mark.parametrize("preset, batch, lr, expected", [
    (None, 128, None, 1e-3), (None, 512, None, 2e-3), ("mnist", 128, None, 2e-3), ("mnist", 32, None, 1e-3),
    (None, 32, None, 5e-4),
    ("mnist", 128, 5e-4, 5e-4), ("tiny", 128, None, 1e-3),
])
def test_learning_rate_follows_flag_then_preset_then_default_scaled_to_the_batch(preset, batch, lr, expected):
    settings = TrainSettings(data="mnist", out="unused", preset=preset, batch_size=batch, lr=lr)
    assert peak_learning_rate(settings, batch) == pytest.approx(expected)


@pytest.mark.parametrize("lr, init, expected", [(None, None, 2.5e-4), (1e-3, None, 1e-3), (None, "some/vit", 5e-5)])
def test_a_small_photo_folder_gets_half_the_default_rate_unless_lr_or_init_say_otherwise(lr, init, expected):
    settings = TrainSettings(data="photos", out="unused", batch_size=32, lr=lr, init=init)
    assert peak_learning_rate(settings, 32, small_photos=True) == pytest.approx(expected)


def test_a_small_photo_folder_trains_at_the_small_photo_rate_and_resumes_at_it(tmp_path):
    """The rate follows from the data the run described when it chose its model; a resumed run
    does not describe the data again, so it must read the rate from its checkpoint."""
    photos = tmp_path / "photos"
    for label, level in (("bright", 190), ("dark", 70)):
        (photos / label).mkdir(parents=True)
        for index in range(6):  # 60x72 px: photos (over 40 px), far fewer than 10,000
            Image.fromarray(np.full((60, 72, 3), level + 5 * index, np.uint8)).save(photos / label / f"{index}.png")
    out = tmp_path / "run"
    expected = f"lr {SMALL_PHOTO_LEARNING_RATE * math.sqrt(8 / 128):g},"
    _, stdout, _ = quietly(train, tiny_settings(photos, out, lr=None, epochs=2), stop_after_epochs=1)
    assert expected in stdout
    resumed, stdout, _ = quietly(train, TrainSettings(data="", out=str(out)), resume=True)
    assert expected in stdout and [record["epoch"] for record in resumed["history"]] == [1, 2]


def test_config_stores_labels_and_the_training_split_mean_and_std(learned_run, image_folder):
    config = ViTConfig.from_json(learned_run["out"] / "config.json")
    assert config.labels == ["bright_disc", "dark_square"]
    assert (config.image_size, config.embed_dim, config.depth) == ([16, 16], 16, 1)
    splits = vdata.load_splits(str(image_folder), val_split=0.25, seed=0)
    probe = ViTConfig(**{**config.to_dict(), "mean": None, "std": None})
    assert (config.mean, config.std) == tuple(vdata.compute_mean_std(splits.train, probe, seed=0))
    assert config.mean != [0.5, 0.5, 0.5] and len(config.std) == 3


def test_saved_model_reproduces_the_final_accuracy(learned_run, image_folder):
    model = HubVisionTransformer.from_pretrained(str(learned_run["out"]))
    splits = vdata.load_splits(str(image_folder), val_split=0.25, seed=0)
    loader = batches.make_loader(batches.Transformed(splits.val, batches.EvalTransform(model.config)), 64,
                               shuffle=False, seed=0, num_workers=0, pin_memory=False)
    result = evaluate(model, loader, torch.device("cpu"), 2)
    final = learned_run["metrics"]["final"]
    assert result["accuracy"] == final["accuracy"] and result["n"] == final["n"]
    assert result["loss"] == pytest.approx(final["loss"], rel=1e-6)


def test_metrics_and_card_record_the_run(learned_run):
    out, settings = learned_run["out"], learned_run["settings"]
    metrics = read_json(out / "metrics.json")
    assert [record["epoch"] for record in metrics["history"]] == [1, 2, 3, 4, 5]
    assert {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr", "images_per_second"} <= set(
        metrics["history"][0])
    assert metrics["settings"] == dataclasses.asdict(settings)
    card = (out / "README.md").read_text()
    assert card.startswith("---\n")
    assert "library_name: vit_hub" in card and "pipeline_tag: image-classification" in card
    assert settings.command in card
    assert "![training curves](curves.png)" in card


def test_checkpoint_holds_model_optimizer_and_run_state(learned_run):
    path = learned_run["out"] / CHECKPOINT
    state = read_checkpoint_state(learned_run["out"])
    assert state["epoch"] == 5 and len(state["history"]) == 5
    assert state["settings"] == dataclasses.asdict(learned_run["settings"])
    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
    assert any(key.startswith("model/") for key in keys)
    assert any(key.startswith("optimizer/") and key.endswith("/exp_avg") for key in keys)


def test_strict_run_fails_on_the_corrupt_file(image_folder, corrupt_file, tmp_path):
    with pytest.raises(vdata.DataError, match=f"unreadable image {corrupt_file}"):
        train(tiny_settings(image_folder, tmp_path / "out", strict=True))
    assert not (tmp_path / "out").exists()


# Resume and Ctrl-C ----------------------------------------------------------------------------------
# Every source of randomness is on: augmentation, dropout, stochastic depth, shuffling.
RANDOM_RUN = dict(augment="photos", model={**TINY_MODEL, "dropout": 0.1, "drop_path": 0.1}, epochs=2)


@pytest.fixture(scope="module")
def straight_run(split_image_folder, tmp_path_factory):
    """Two epochs without a break: what every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("straight") / "model"
    metrics, _, _ = quietly(train, tiny_settings(split_image_folder, out, **RANDOM_RUN))
    return dict(out=out, metrics=metrics)


def scripted_validation(monkeypatch, scores):
    """Trainer._validate answers `scores` ((accuracy, loss) per epoch) instead of evaluating."""
    scripted = iter(scores)
    monkeypatch.setattr(Trainer, "_validate", lambda self: dict(zip(("val_accuracy", "val_loss"), next(scripted))))


def best_epochs(stdout):
    return [json.loads(line.removesuffix("  (best)"))["epoch"] for line in stdout.splitlines()
            if line.endswith("  (best)")]


def test_ties_in_validation_accuracy_go_to_the_lower_validation_loss(image_folder, tmp_path, monkeypatch):
    """A validation split that may choose (here: any size) hits 100 % early; the model kept is
    the best one after that."""
    monkeypatch.setattr(checkpoint, "MIN_VAL_TO_CHOOSE", 1)
    scripted_validation(monkeypatch, [(0.5, 0.7), (1.0, 0.5), (1.0, 0.2), (1.0, 0.3)])
    metrics, stdout, _ = quietly(train, tiny_settings(image_folder, tmp_path / "run", epochs=4))
    assert best_epochs(stdout) == [1, 2, 3] and metrics["best_val_accuracy"] == 1.0
    assert metrics["kept"]["epoch"] == 3 and metrics["kept"]["by_validation"]
    assert "weights kept: the best epoch by validation accuracy (12 validation images)" in stdout


def test_a_validation_split_too_small_to_choose_by_keeps_the_last_epoch(image_folder, tmp_path, monkeypatch):
    """12 validation images: a lucky epoch 2 is the best on validation, the last epoch is kept,
    and the log, the summary line and metrics.json say so and why."""
    scripted_validation(monkeypatch, [(0.5, 0.7), (1.0, 0.2), (0.75, 0.5), (0.75, 0.4)])
    out = tmp_path / "run"
    metrics, stdout, _ = quietly(train, tiny_settings(image_folder, out, epochs=4))
    assert best_epochs(stdout) == [1, 2] and metrics["best_val_accuracy"] == 1.0
    assert metrics["kept"] == read_json(out / "metrics.json")["kept"]
    assert metrics["kept"]["epoch"] == 4 and not metrics["kept"]["by_validation"]
    assert "12 validation images are too few to choose an epoch by" in metrics["kept"]["reason"]
    assert f"weights kept: {metrics['kept']['reason']}" in stdout
    assert json.loads(stdout.splitlines()[-1])["kept_epoch"] == 4
    last_epoch = {name.removeprefix("model/"): tensor for name, tensor in weights(out / CHECKPOINT).items()
                  if name.startswith("model/")}
    assert_same_tensors(weights(out / "model.safetensors"), last_epoch)


@pytest.mark.parametrize("images, by_validation", [(None, True), (999, False), (1000, True), (6000, True)])
def test_the_selection_rule_follows_the_size_of_the_validation_split(images, by_validation):
    assert checkpoint.Selection.for_validation(images).by_validation == by_validation


def test_validation_and_test_are_reported_side_by_side(straight_run):
    metrics = straight_run["metrics"]
    assert set(metrics["evaluation"]) == {"val", "test"}
    assert metrics["evaluation"]["test"] == {key: metrics["final"][key] for key in ("accuracy", "loss", "n")}
    assert metrics["evaluation"]["val"]["n"] == 8 and metrics["evaluation"]["test"]["n"] == 16  # 25 % of 32; 2 x 8
    card = (straight_run["out"] / "README.md").read_text()
    assert "| split | accuracy | loss | images |" in card and "| val |" in card and "| test |" in card


def assert_same_run(out, straight_run):
    assert_same_tensors(weights(out / "model.safetensors"), weights(straight_run["out"] / "model.safetensors"))
    assert_same_tensors(weights(out / CHECKPOINT), weights(straight_run["out"] / CHECKPOINT))
    assert without_timing(read_json(out / "metrics.json")["history"]) == without_timing(
        straight_run["metrics"]["history"])
    assert read_json(out / "metrics.json")["final"] == straight_run["metrics"]["final"]


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_resume_gives_the_same_result_as_an_uninterrupted_run(split_image_folder, straight_run, tmp_path, workers):
    out = tmp_path / "model"
    settings = tiny_settings(split_image_folder, out, **RANDOM_RUN, num_workers=workers)
    paused, stdout, _ = quietly(train, settings, stop_after_epochs=1)
    assert len(paused["history"]) == 1 and "paused after epoch 1 of 2" in stdout
    assert read_checkpoint_state(out)["epoch"] == 1
    # --resume: every setting comes from the checkpoint
    resumed, _, _ = quietly(train, TrainSettings(data="", out=str(out)), resume=True)
    assert [record["epoch"] for record in resumed["history"]] == [1, 2]
    if workers == 0:
        assert_same_run(out, straight_run)
    else:  # augmentation runs in the worker process: compare with a straight run that has one too
        reference = tmp_path / "straight"
        metrics, _, _ = quietly(train, dataclasses.replace(settings, out=str(reference)))
        assert_same_run(out, dict(out=reference, metrics=metrics))


def test_ctrl_c_leaves_a_checkpoint_that_resumes_to_the_same_result(split_image_folder, straight_run, tmp_path,
                                                                     monkeypatch, capsys):
    out = tmp_path / "model"
    original_lr_at = Schedule.lr_at

    def interrupt_mid_epoch(self, step):
        if step == self.steps_per_epoch + 1:  # the second step of the second epoch, before it runs
            raise KeyboardInterrupt
        return original_lr_at(self, step)

    monkeypatch.setattr(Schedule, "lr_at", interrupt_mid_epoch)
    same_as_straight_run = {**RANDOM_RUN["model"], **TINY_RUN, "epochs": 2, "val_split": 0.25,
                            "augment": RANDOM_RUN["augment"]}
    flags = ["train", "--data", str(split_image_folder), "--out", str(out), *train_flags(same_as_straight_run)]
    assert cli.main(flags) == 130
    assert f"interrupted; continue with: vit-hub train --resume --out {out}" in capsys.readouterr().err
    state = read_checkpoint_state(out)
    assert state["epoch"] == 1 and len(state["history"]) == 1
    HubVisionTransformer.from_pretrained(str(out))  # the best model so far is loadable too

    monkeypatch.setattr(Schedule, "lr_at", original_lr_at)
    assert cli.main(["train", "--resume", "--out", str(out)]) == 0
    assert_same_run(out, straight_run)


def test_a_run_copied_to_another_folder_resumes_there(split_image_folder, tmp_path):
    """The checkpoint's settings name the folder the run started in; a resume writes to the
    folder it was given (and names it in the settings it saves), and leaves the original alone."""
    first, moved = tmp_path / "first", tmp_path / "moved"
    quietly(train, tiny_settings(split_image_folder, first, epochs=2), stop_after_epochs=1)
    shutil.copytree(first, moved)
    before = {path.name: path.read_bytes() for path in first.iterdir()}
    quietly(train, TrainSettings(data="", out=str(moved)), resume=True)
    assert read_checkpoint_state(moved)["epoch"] == 2 and "final" in read_json(moved / "metrics.json")
    assert read_checkpoint_state(moved)["settings"]["out"] == str(moved)
    assert {path.name: path.read_bytes() for path in first.iterdir()} == before


def test_resume_without_a_checkpoint_says_where_it_looked(tmp_path):
    with pytest.raises(TrainingError, match=f"--resume: expected a checkpoint at {tmp_path / CHECKPOINT}"):
        train(TrainSettings(data="", out=str(tmp_path)), resume=True)


# Settings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(epochs=0), "--epochs: expected a positive int, got 0"),
    (dict(lr=-1.0), "--lr: expected a positive, finite learning rate, got -1.0"),
    (dict(lr=float("inf")), "--lr: expected a positive, finite learning rate, got inf"),
    (dict(lr=float("nan")), "--lr: expected a positive, finite learning rate, got nan"),
    (dict(label_smoothing=1.5), r"--label-smoothing: expected a value in \[0, 1\), got 1.5"),
    (dict(grad_clip=0.0), "--grad-clip: expected a positive, finite max gradient norm, got 0.0"),
    (dict(weight_decay=-0.1), "--weight-decay: expected a finite value >= 0, got -0.1"),
    (dict(weight_decay=float("inf")), "--weight-decay: expected a finite value >= 0, got inf"),
    (dict(warmup_epochs=-1.0), "--warmup-epochs: expected a finite value >= 0"),
    (dict(device="tpu"), "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (dict(num_workers=-1), "--workers: expected a count from 0 to 64, got -1"),
    (dict(batch_size=0), "--batch-size: expected a positive multiple of the 1 processes, got 0"),
    (dict(preset="huge"), "--preset: expected one of mnist, small-data, tiny, small, base, got 'huge'$"),
    (dict(device="cuda:0"), "--device cuda: expected a CUDA GPU, found none"),
    (dict(augment="mixup"), "--augment: expected one of auto, digits, photos, none, got 'mixup'$"),
    (dict(model={**TINY_MODEL, "num_heads": 3}), "embed_dim 16 is not divisible by num_heads 3"),
])
def test_settings_that_cannot_train_fail_before_training(split_image_folder, tmp_path, overrides, message):
    if overrides.get("device", "").startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=message):
        train(tiny_settings(split_image_folder, tmp_path / "out", **overrides))
    assert not (tmp_path / "out" / CHECKPOINT).exists()


def test_config_takes_preset_then_flags_and_keeps_given_normalisation(split_image_folder, tmp_path):
    splits = vdata.load_splits(str(split_image_folder))
    settings = tiny_settings(split_image_folder, tmp_path, preset="mnist",
                             model={"depth": 2, "in_channels": 3, "mean": [0.3]})
    config = build_config(settings, splits)
    assert (config.embed_dim, config.depth, config.patch_size) == (64, 2, [4, 4])
    assert config.labels == ["bright_disc", "dark_square"] and config.num_classes == 2
    assert config.mean == [0.3, 0.3, 0.3]  # given: kept
    assert config.std == [0.3081] * 3  # from the preset


def test_only_missing_normalisation_is_measured(split_image_folder, tmp_path):
    splits = vdata.load_splits(str(split_image_folder))
    config = build_config(tiny_settings(split_image_folder, tmp_path, model={**TINY_MODEL, "std": [0.25]}), splits)
    assert config.std == [0.25] * 3
    assert config.mean != [0.5] * 3 and all(0 < value < 1 for value in config.mean)


def test_without_preset_the_architecture_is_chosen_from_the_data(split_image_folder, tmp_path):
    splits = vdata.load_splits(str(split_image_folder))
    config = build_config(tiny_settings(split_image_folder, tmp_path, model={}), splits)
    # 30 small RGB images (median side ~35 px): 32x32 inputs and the small-data tricks; grayscale,
    # since brightness alone tells a bright disc from a dark square (vit_hub/data/colour.py)
    assert (config.image_size, config.patch_size, config.in_channels) == ([32, 32], [4, 4], 1)
    assert config.pixel_norm == "dataset"  # images of 40 px or less are not photos
    assert config.patch_embedding == "convstem" and config.locality_attention and config.drop_path > 0


def test_a_patch_size_the_conv_stem_cannot_reach_falls_back_to_shifted_patches(split_image_folder, tmp_path):
    splits = vdata.load_splits(str(split_image_folder))
    chosen = build_config(tiny_settings(split_image_folder, tmp_path, model=dict(image_size=36, patch_size=6)), splits)
    assert chosen.patch_embedding == "shifted"
    asked = tiny_settings(split_image_folder, tmp_path, model=dict(image_size=36, patch_size=6, patch_embedding="convstem"))
    with pytest.raises(ConfigError, match=r"patch_embedding convstem: expected patch sides that are powers of two "
                                          r".*, got patch_size \[6, 6\]"):
        build_config(asked, splits)


def test_mnist_preset_keeps_its_published_normalisation():
    splits = vdata.load_splits("mnist")
    config = build_config(TrainSettings(data="mnist", out="unused", preset="mnist"), splits)
    assert (config.mean, config.std) == ([0.1307], [0.3081])
    assert config.labels == list(DIGIT_LABELS)


# Schedule, optimizer groups, checkpoints, evaluation ---------------------------------------------------
def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_one_percent():
    rates = [learning_rate(step, total_steps=100, warmup_steps=10, peak=1.0) for step in range(100)]
    assert rates[:10] == pytest.approx([(step + 1) / 10 for step in range(10)])
    assert rates[10] == pytest.approx(1.0)
    assert all(later <= earlier for earlier, later in zip(rates[10:], rates[11:]))
    assert rates[55] == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(100, 100, 10, 1.0) == pytest.approx(0.01)


def test_default_epochs_see_about_200k_samples_within_bounds():
    assert default_epochs(60_000) == 10  # at least 10
    assert default_epochs(4_000) == 50
    assert default_epochs(100) == 200  # at most 200


def test_weight_decay_spares_biases_norms_positions_and_class_token():
    model = HubVisionTransformer(**tiny_config(depth=1))
    decay, no_decay = parameter_groups(model, 0.05)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(name.endswith("weight") and "norm" not in name for name in decayed)
    assert {"cls_token", "pos_embedding", "head.bias", "norm.weight"} <= {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


def test_checkpoint_round_trip_restores_model_and_optimizer_exactly(tmp_path):
    torch.manual_seed(0)
    model = HubVisionTransformer(**tiny_config(locality_attention=True))
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.05), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 3, 16, 16)).logits.square().sum().backward()
        optimizer.step()
    save_checkpoint(tmp_path / CHECKPOINT, model, optimizer, {"epoch": 3, "note": "hi"})
    assert [path.name for path in tmp_path.iterdir()] == [CHECKPOINT]  # no partial file left

    restored = HubVisionTransformer(**tiny_config(locality_attention=True))
    restored_optimizer = torch.optim.AdamW(parameter_groups(restored, 0.05), lr=1e-3)
    state = load_checkpoint(tmp_path / CHECKPOINT, restored, restored_optimizer)
    assert state == {"epoch": 3, "note": "hi"}
    assert_same_tensors(restored.state_dict(), model.state_dict())
    original, loaded = optimizer.state_dict(), restored_optimizer.state_dict()
    as_json = lambda groups: json.loads(json.dumps(groups))  # noqa: E731  (betas come back as a list)
    assert as_json(original["param_groups"]) == as_json(loaded["param_groups"])
    for index, values in original["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][index][key])), (index, key)


class FixedLogits(torch.nn.Module):
    """A 'model' that returns the logits it is fed as images."""

    def forward(self, images):
        return ViTOutput(images)


def test_evaluate_counts_accuracy_loss_and_confusion():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 3.0]])
    labels = torch.tensor([0, 1, 1, 1])
    loader = [(logits[:3], labels[:3]), (logits[3:], labels[3:])]
    result = evaluate(FixedLogits(), loader, torch.device("cpu"), num_classes=2)
    assert result["accuracy"] == 0.75 and result["n"] == 4
    assert result["confusion"] == [[1, 0], [1, 2]]  # rows: true class
    expected_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert result["loss"] == pytest.approx(expected_loss)


def test_presets_all_train_one_step():
    """Every preset's config goes through one optimizer step (at a small size) without error."""
    for name in PRESETS:
        values = {**PRESETS[name], "image_size": 32, "patch_size": 8, "depth": 1, "num_classes": None,
                  "labels": ["a", "b"]}
        model = HubVisionTransformer(**values).train()
        optimizer = torch.optim.AdamW(parameter_groups(model, 0.05), lr=1e-3)
        loss = model(torch.randn(2, model.config.in_channels, 32, 32)).logits.logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        assert math.isfinite(loss.item()), name


# Reproducible input pipeline, the step's choices ----------------------------------------------------------
def test_the_same_seed_gives_the_same_model_with_or_without_loader_workers(image_folder, tmp_path):
    """Photo augmentation (drawn in the workers), dropout and drop-path (the main process), the
    corrupt file replaced: two steps with 0 and with 2 workers give identical weights."""
    runs = {}
    for workers in (0, 2):
        settings = tiny_settings(image_folder, tmp_path / str(workers), epochs=1, batch_size=16, augment="photos",
                                 num_workers=workers, model=dict(TINY_MODEL, dropout=0.1, drop_path=0.1))
        runs[workers], _, _ = quietly(train, settings)
    assert_same_tensors(weights(tmp_path / "0" / CHECKPOINT), weights(tmp_path / "2" / CHECKPOINT))
    assert without_timing(runs[0]["history"]) == without_timing(runs[2]["history"])


def test_evaluation_inputs_equal_preprocess_exactly(split_image_folder, tmp_path):
    with running("cpu") as runtime:
        trainer = build_trainer(tiny_settings(split_image_folder, tmp_path / "out", num_workers=2), runtime)
    images = torch.cat([batch for batch, _ in trainer.loaders.eval_loader("test")])
    expected = [torch.from_numpy(preprocess(path, trainer.plan.config)) for path, _ in trainer.data.splits.test.samples]
    assert images.dtype == torch.float32 and torch.equal(images, torch.stack(expected))


@pytest.mark.parametrize("requested, device, steps, triton, capability, compiled, reason", [
    (None, "cpu", 10**6, True, None, False, "the default on the CPU"),
    (True, "cpu", 10, False, None, True, "--compile"),
    (False, "cuda", 10**6, True, (9, 0), False, "--no-compile"),
    (None, "cuda", 10**6, True, (9, 0), True, "the default for 1000000 steps on CUDA"),
    (None, "cuda", 4999, True, (9, 0), False, "4999 steps are too few to repay the compile time"),
    (None, "cuda", 10**6, False, (9, 0), False, "needs Triton"),
    (None, "cuda", 10**6, True, (6, 1), False, "compute capability 7.0 or newer, this one is 6.1"),
])
def test_compile_is_chosen_when_it_pays_and_the_log_says_why(requested, device, steps, triton, capability,
                                                              compiled, reason):
    chosen, why = choose_compile(requested, device, steps, triton, capability)
    assert chosen == compiled and reason in why


def test_the_training_log_says_how_the_step_runs(learned_run):
    assert "step: eager (the default on the CPU; --compile to try it)" in learned_run["stdout"]
    assert "GFLOP per training image (forward + backward)" in learned_run["stdout"]
    record = learned_run["metrics"]["history"][0]
    assert record["model_tflop_s"] > 0 and "mfu" not in record  # no MFU on the CPU: it has no one peak


def test_flops_are_counted_on_the_meta_device_as_on_real_tensors():
    from torch.utils.flop_counter import FlopCounterMode

    model = HubVisionTransformer(**tiny_config(dropout=0.1))
    counter = FlopCounterMode(display=False)
    with counter, torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        model(torch.randn(1, 3, 16, 16)).logits.sum().backward()
    state = torch.random.get_rng_state()
    assert training_flops(model) == counter.get_total_flops() > 0
    assert torch.equal(torch.random.get_rng_state(), state)  # no random numbers drawn


def test_inference_flops_are_counted_on_the_meta_device_as_on_real_tensors():
    """`vit-hub info`'s per-layer counts: the forward pass in eval mode, module by module."""
    from torch.utils.flop_counter import FlopCounterMode

    model = HubVisionTransformer(**tiny_config(dropout=0.1, pooling="mean")).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        model(torch.randn(1, 3, 16, 16))
    counts = count_flops(model)
    assert counts == counter.get_flop_counts() and module_flops(counts, TOTAL) > 0
    assert module_flops(counts, "HubVisionTransformer.blocks.0.attention") > 0
    assert training_flops(model) > module_flops(counts, TOTAL)  # the backward pass is counted too
    assert not model.training  # the count leaves the model as it was


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989), ("NVIDIA H100 PCIe", torch.bfloat16, 756),
    ("NVIDIA H100 NVL", torch.float16, 835), ("NVIDIA H200", torch.bfloat16, 989),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312), ("NVIDIA A100-PCIE-40GB", torch.float32, 156),
    ("NVIDIA L4", torch.bfloat16, 121), ("NVIDIA L40S", torch.bfloat16, None), ("Tesla T4", torch.float16, None),
])
def test_mfu_uses_the_gpus_dense_peak_and_only_known_gpus(name, dtype, tflops):
    peak = peak_flops(name, dtype)
    assert peak == (None if tflops is None else tflops * 1e12)
    rates = flop_rates(250e12, peak)
    assert rates["model_tflop_s"] == 250
    assert ("mfu" in rates) == (tflops is not None)
    if tflops:
        assert rates["mfu"] == pytest.approx(250 / tflops)
