"""DDP on CPU: `torchrun --nproc_per_node 2` with gloo, on a tiny generated dataset."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from vit_hub import data as vdata
from vit_hub.pretrained import load_model
from vit_hub.train import CHECKPOINT, evaluate, read_checkpoint_state

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
MODEL_FLAGS = ["--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--image-size", "16",
               "--patch-size", "4", "--batch-size", "8", "--workers", "0", "--seed", "3"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shapes_folder(tmp_path_factory) -> Path:
    """Two classes (bright disc / bright bar) of 24 images each, 20-30 px."""
    root = tmp_path_factory.mktemp("shapes")
    for label in ("bar", "disc"):
        (root / label).mkdir()
        for index in range(24):
            size = 20 + index % 11
            image = Image.new("RGB", (size, size), (20, 20, 40))
            draw = ImageDraw.Draw(image)
            if label == "disc":
                draw.ellipse([3, 3, size - 4, size - 4], fill=(230, 200, 40))
            else:
                draw.rectangle([size // 2 - 2, 1, size // 2 + 2, size - 2], fill=(230, 200, 40))
            image.save(root / label / f"{index}.png")
    return root


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*TORCHRUN, "-m", "vit_hub", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ddp_run(shapes_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "model"
    result = torchrun("train", "--data", str(shapes_folder), "--out", str(out), "--epochs", "2", *MODEL_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_ddp_training_finishes_and_only_rank0_writes(ddp_run):
    out, result = ddp_run
    files = sorted(path.name for path in out.iterdir())
    assert files == sorted(["README.md", CHECKPOINT, "config.json", "confusion_matrix.png", "curves.png",
                            "metrics.json", "model.safetensors", "inspect.json", "patch_filters.png",
                            "position_similarity.png", "attention_distance.png"])
    # One summary line: printed by rank 0 alone.
    summaries = [line for line in result.stdout.splitlines() if line.startswith('{"out"')]
    assert len(summaries) == 1
    assert result.stdout.count("2 process(es)") == 1


def test_ddp_metrics_equal_single_process_evaluation(ddp_run, shapes_folder):
    """The final accuracy under DDP (sharded, summed across ranks) equals evaluating the
    saved model on the whole validation split in one process."""
    out, _ = ddp_run
    metrics = json.loads((out / "metrics.json").read_text())
    model = load_model(out)
    splits = vdata.load_splits(str(shapes_folder), val_split=0.1, seed=3)
    loader = vdata.make_loader(vdata.Transformed(splits.val, vdata.EvalTransform(model.config)), 7,
                               shuffle=False, seed=0, num_workers=0, pin_memory=False)
    single = evaluate(model, loader, torch.device("cpu"), model.config.num_classes)
    assert metrics["final"]["n"] == single["n"] == len(splits.val)
    assert metrics["final"]["accuracy"] == pytest.approx(single["accuracy"], abs=1e-12)
    assert metrics["final"]["loss"] == pytest.approx(single["loss"], rel=1e-5)


def test_ddp_model_loads_in_one_process_with_identical_logits(ddp_run):
    out, _ = ddp_run
    model = load_model(out)
    again = load_model(out)
    pixels = torch.randn(3, model.config.in_channels, *model.config.image_size)
    assert torch.equal(model(pixels).logits, again(pixels).logits)
    assert not any(key.startswith("module.") for key in model.state_dict())


def test_ddp_resume_continues_to_the_same_result(shapes_folder, tmp_path):
    """Train 1 epoch of a 2-epoch run, resume under DDP: same weights as straight through."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert torchrun("train", "--data", str(shapes_folder), "--out", str(straight), "--epochs", "2",
                    *MODEL_FLAGS).returncode == 0
    first = torchrun("train", "--data", str(shapes_folder), "--out", str(resumed), "--epochs", "2",
                     *MODEL_FLAGS, "--stop-after-epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert read_checkpoint_state(resumed)["epoch"] == 1
    second = torchrun("train", "--resume", "--out", str(resumed))
    assert second.returncode == 0, second.stderr[-3000:]
    from safetensors.torch import load_file

    expected, actual = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


SHARE_SCRIPT = """
import os, sys
import torch.distributed as dist
from vit_hub import data as vdata
from vit_hub.train import Trainer, TrainSettings

listed = vdata.index_image_folder
def index_image_folder(root):
    print(f"rank {os.environ['RANK']} lists the folder", flush=True)
    return listed(root)
vdata.index_image_folder = index_image_folder
model = dict(embed_dim=16, depth=1, num_heads=2, image_size=16, patch_size=4)
trainer = Trainer(TrainSettings(data=sys.argv[1], out=sys.argv[2], device="cpu", num_workers=0, batch_size=8,
                                epochs=1, model=model, seed=3))
print(f"rank {os.environ['RANK']}: {len(trainer.splits.train)} training images, mean {trainer.config.mean}", flush=True)
dist.destroy_process_group()
"""


def test_the_folder_is_listed_once_and_shared_with_every_process(shapes_folder, tmp_path):
    script = tmp_path / "share.py"
    script.write_text(SHARE_SCRIPT)
    package_root = str(Path(vdata.__file__).parents[1])  # the vit_hub under test, wherever the script is
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([*TORCHRUN, str(script), str(shapes_folder), str(tmp_path / "out")], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("lists the folder") == 1 and "rank 0 lists the folder" in result.stdout
    # (the two processes' lines may interleave on one line of the captured output)
    reports = re.findall(r"rank (\d): (\d+ training images, mean \[[^\]]*\])", result.stdout)
    assert sorted(rank for rank, _ in reports) == ["0", "1"]
    assert reports[0][1] == reports[1][1]  # the same split and the same measured config
