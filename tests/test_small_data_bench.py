"""bench/small_data.py's table (mean, spread and distance to the ResNet-18 per folder) and its
smoke-test subset of a folder; the runs themselves are the benchmark, not a test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import small_data
from conftest import write_class_folders
from vit_hub.model.vit import ViTOutput


def record(folder: str, row: str, seed: int, test: float, **extra) -> dict:
    return {"folder": folder, "row": row, "seed": seed, "test": test, "test_flips": test + 0.01, **extra}


def test_the_table_gives_each_rows_mean_spread_and_distance_to_the_resnet():
    results = [record("photos", "defaults", 0, 0.70), record("photos", "defaults", 1, 0.76),
               record("photos", "resnet18", 0, 0.72, last_test=0.7, last_test_flips=0.71),
               record("photos", "resnet18", 1, 0.74, last_test=0.7, last_test_flips=0.71),
               {"folder": "photos", "row": "defaults", "seed": 2, "error": "exit code 1"}]
    lines = small_data.folder_table(results, "photos", [0, 1])
    defaults = next(line for line in lines if line.startswith("| ViT defaults |"))
    assert defaults == "| ViT defaults | 0.700 | 0.760 | **0.730** | 6.0 | +0.0 / +3.0 |"
    flipped = next(line for line in lines if line.startswith("| ViT defaults, test-time flips |"))
    assert flipped.endswith("| **0.740** | 6.0 | +1.0 / +4.0 |")
    assert [line.split(" | ")[0] for line in lines[4:]] == [  # after the title, a blank line, the header and the rule
        "| ViT defaults", "| ViT defaults, test-time flips", "| **ResNet-18 reference** (best validation epoch)",
        "| ResNet-18 reference, test-time flips", "| ResNet-18 reference, last epoch",
        "| ResNet-18 reference, last epoch, test-time flips"]
    detail = "\n".join(small_data.detail_table([results[-1]]))
    assert "failed: exit code 1" in detail


def test_a_partial_row_shows_its_seeds_but_no_distance(tmp_path):
    results = [record("photos", "defaults", 0, 0.70), record("photos", "resnet18", 0, 0.72, last_test=0.7),
               record("photos", "resnet18", 1, 0.74, last_test=0.7)]
    row = next(line for line in small_data.folder_table(results, "photos", [0, 1]) if line.startswith("| ViT defaults |"))
    assert row == "| ViT defaults | 0.700 |  | **0.700** | 0.0 |  |"


def test_the_subset_copies_the_first_photos_of_each_class(tmp_path):
    for split, count in (("train", 6), ("test", 4)):
        write_class_folders(tmp_path / "data" / split, per_class=count, seed=0)
    copy = small_data.subset(tmp_path / "data", tmp_path / "out", per_class=3)
    for split, count in (("train", 3), ("test", 1)):
        for folder in sorted((tmp_path / "data" / split).iterdir()):
            assert sorted(p.name for p in (copy / split / folder.name).iterdir()) == \
                sorted(p.name for p in folder.iterdir())[:count]
    assert isinstance(copy, Path) and copy.name == "data-subset3"


def test_each_row_runs_its_own_command_on_the_device_and_workers_given(tmp_path):
    args = small_data.parse_args(["--device", "cuda", "--workers", "2", "--out", str(tmp_path)])
    budget = {"train": 450, "epochs": 200, "batch_size": 32, "image_size": 64}
    commands = {row: small_data.run_command(row, tmp_path / "photos", tmp_path / "run", 1, args, budget)
                for row in small_data.ROWS}
    for command in commands.values():
        assert command[command.index("--device") + 1] == "cuda" and command[command.index("--workers") + 1] == "2"
        assert command[command.index("--seed") + 1] == "1"
    assert "--epochs" not in commands["defaults"]  # the defaults' own
    resnet = commands["resnet18"]
    assert [resnet[resnet.index(flag) + 1] for flag in ("--epochs", "--batch-size", "--image-size")] == ["200", "32", "64"]


def test_a_candidate_change_reaches_the_vit_row_alone_and_a_size_reaches_both(tmp_path):
    args = small_data.parse_args(["--image-size", "128", "--vit-flags", "--pos-embedding sincos --depth 8",
                                  "--out", str(tmp_path)])
    for split in ("train", "test"):
        write_class_folders(tmp_path / "photos" / split, per_class=4, seed=0)
    tasks = small_data.plan([tmp_path / "photos"], args)
    assert {task["budget"]["image_size"] for task in tasks} == {128}  # the ResNet row's size too
    budget = tasks[0]["budget"]
    vit = small_data.run_command("defaults", tmp_path / "photos", tmp_path / "run", 0, args, budget)
    resnet = small_data.run_command("resnet18", tmp_path / "photos", tmp_path / "run", 0, args, budget)
    assert vit[vit.index("--image-size"):] == ["--image-size", "128", "--patch-size", "16",
                                               "--pos-embedding", "sincos", "--depth", "8"]
    assert resnet[resnet.index("--image-size") + 1] == "128" and "--pos-embedding" not in resnet


@pytest.mark.parametrize("size", ["100", "4", "0", "-8"])
def test_an_input_size_off_the_token_grid_is_refused_in_one_line(size, capsys):
    """--image-size must be a positive multiple of 8: 0 (which would fall back to the defaults'
    size unsaid) and -8, multiples of 8 both, are refused as 100 and 4 are."""
    with pytest.raises(SystemExit):
        small_data.parse_args(["--image-size", size])
    assert f"--image-size: expected a multiple of 8 of at least 8, got {size}" in capsys.readouterr().err


class LeftHalfVotes(torch.nn.Module):
    """Logits [B, 2] from the mean brightness of an image's left half against its right half;
    as a vit_hub model (a ViTOutput) or a torchvision one (a tensor)."""

    def __init__(self, vit_output: bool):
        super().__init__()
        self.vit_output = vit_output

    def forward(self, images):
        width = images.shape[-1]
        left, right = images[..., : width // 2].mean((1, 2, 3)), images[..., width // 2:].mean((1, 2, 3))
        logits = torch.stack([left - right, 0.1 * (right - left)], 1)
        return ViTOutput(logits=logits) if self.vit_output else logits


def test_test_time_flips_score_each_image_by_its_logits_and_its_mirror_images():
    images = torch.zeros(2, 1, 4, 4)
    images[0, ..., :2] = 1  # bright on the left: logits (1, -0.1), class 0; mirrored (-1, 0.1)
    images[1, ..., 2:] = 1  # bright on the right: logits (-1, 0.1), class 1; mirrored (1, -0.1)
    loader = [(images, torch.tensor([0, 1]))]
    for vit_output in (True, False):
        model = LeftHalfVotes(vit_output)
        assert small_data.accuracy(model, loader, "cpu") == 1.0
        flipped = small_data.accuracy(model, loader, "cpu", flips=True)
        assert flipped == 0.5  # each image's mean with its mirror is (0, 0): class 0, right for the first image only
