"""Distillation from a convolutional teacher trained beside the ViT (`--teacher resnet18`,
vit_hub/train/teacher.py) and test-time flips at evaluation (`vit-hub eval --flips`)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_MODEL, read_json
from test_cli import run_main
from test_train import quietly, tiny_settings
from vit_hub.model.config import ViTConfig
from vit_hub.model.vit import ViTOutput
from vit_hub.train.evaluation import evaluate
from vit_hub.train.run import train
from vit_hub.train.settings import TrainingError
from vit_hub.train.teacher import Teacher, check_teacher, distillation_loss


def test_distillation_is_half_the_labels_half_the_teachers_classes():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.2, 0.1]])
    labels, taught = torch.tensor([0, 2]), torch.tensor([1, 2])
    expected = (F.cross_entropy(logits, labels, label_smoothing=0.1) + F.cross_entropy(logits, taught)) / 2
    assert distillation_loss(logits, labels, taught, 0.1).item() == pytest.approx(expected.item())


@pytest.mark.parametrize("channels", [1, 3])
def test_the_teacher_learns_a_batch_and_returns_its_classes(channels):
    config = ViTConfig(**{**TINY_MODEL, "in_channels": channels, "image_size": 32}, labels=["a", "b", "c"])
    teacher = Teacher(config, torch.device("cpu"), seed=0, student_peak_lr=1e-3)
    images, labels = torch.randn(6, channels, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2])
    teacher.set_lr(1e-3)
    assert teacher.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # TEACHER_LR at the ViT's peak
    for _ in range(30):
        taught = teacher.update(images, labels, label_smoothing=0.0, amp_dtype=None)
    assert taught.shape == (6,) and taught.dtype == torch.int64
    assert torch.equal(taught, labels)  # it fits the batch it trains on


def test_a_run_with_a_teacher_distils_and_reports_the_teachers_accuracy(split_image_folder, tmp_path):
    plain, _, _ = quietly(train, tiny_settings(split_image_folder, tmp_path / "plain"))
    taught, stdout, _ = quietly(train, tiny_settings(split_image_folder, tmp_path / "taught", teacher="resnet18"))
    assert "teacher: resnet18, trained beside the model" in stdout
    teacher = read_json(tmp_path / "taught" / "metrics.json")["teacher"]
    assert teacher["network"] == "resnet18" and 0 <= teacher["val"] <= 1 and 0 <= teacher["test"] <= 1
    assert "teacher" not in plain
    # the same seed, batches and initial weights: only the second targets differ
    assert plain["history"][0]["train_loss"] != taught["history"][0]["train_loss"]


@pytest.mark.parametrize("processes, resume, pausing, expected", [
    (2, False, False, "expected one process, found 2"),
    (1, True, False, "got --resume"),
    (1, False, True, "got --stop-after-epochs"),
])
def test_a_teacher_trains_in_one_process_from_start_to_end(processes, resume, pausing, expected):
    check_teacher(None, processes, resume, pausing)  # no teacher: nothing to refuse
    with pytest.raises(TrainingError, match=expected):
        check_teacher("resnet18", processes, resume, pausing)


def test_a_paused_run_with_a_teacher_is_refused_before_training(split_image_folder, tmp_path):
    with pytest.raises(TrainingError, match="--stop-after-epochs"):
        quietly(train, tiny_settings(split_image_folder, tmp_path / "out", teacher="resnet18"), stop_after_epochs=1)
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_the_teacher_flag_takes_the_known_networks_only(split_image_folder, tmp_path):
    code, _, stderr = run_main(["train", "--data", split_image_folder, "--out", tmp_path / "out",
                                "--teacher", "vgg"])
    assert code == 2 and "invalid choice: 'vgg'" in stderr and "resnet18" in stderr


class MirrorSensitive(torch.nn.Module):
    """Logits [B, 2] from the left and right halves of each image: a mirror image swaps them."""

    def forward(self, images):
        left, right = images[..., : images.shape[-1] // 2], images[..., images.shape[-1] // 2 :]
        return ViTOutput(torch.stack([left.mean((1, 2, 3)), 2 * right.mean((1, 2, 3))], dim=1))


def test_flips_score_the_mean_of_an_image_and_its_mirror_image():
    images = torch.rand(5, 3, 4, 6)
    labels = torch.tensor([0, 1, 0, 1, 1])
    model = MirrorSensitive()
    mean = (model(images).logits + model(images.flip(-1)).logits) / 2
    plain = evaluate(model, [(images, labels)], torch.device("cpu"), num_classes=2)
    flipped = evaluate(model, [(images, labels)], torch.device("cpu"), num_classes=2, flips=True)
    assert flipped["loss"] == pytest.approx(F.cross_entropy(mean, labels).item())
    assert flipped["loss"] != pytest.approx(plain["loss"])
    assert flipped["accuracy"] == int((mean.argmax(1) == labels).sum()) / len(labels)


def test_eval_with_flips_prints_its_accuracy_and_says_so(split_image_folder, tmp_path):
    quietly(train, tiny_settings(split_image_folder, tmp_path / "run"))
    results = {}
    for flips in ([], ["--flips"]):
        code, stdout, stderr = run_main(["eval", "--model", tmp_path / "run", "--data", split_image_folder, *flips])
        assert code == 0, stderr
        results[bool(flips)] = json.loads(stdout)
    assert results[True]["flips"] is True and results[False]["flips"] is False
    assert results[True]["n"] == results[False]["n"] == 16 and 0 <= results[True]["accuracy"] <= 1
    assert results[True]["loss"] != results[False]["loss"]
