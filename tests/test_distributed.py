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

from vit_hub.data import batches
from vit_hub.data import sources as vdata
from vit_hub.hub.pretrained import load_model
from vit_hub.layout import ModelDir
from vit_hub.train.checkpoint import read_checkpoint_state
from vit_hub.train.evaluation import evaluate

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
MODEL_FLAGS = ["--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--image-size", "16",
               "--patch-size", "4", "--batch-size", "8", "--workers", "0", "--seed", "3"]
# What makes one process's arithmetic differ from two's by more than the order of float sums:
# dropout masks drawn per process, and the conv stem's BatchNorm statistics taken per process.
# Without them, two processes compute what one does (the same global batches, augmentation,
# initial weights and averaged gradient).
SAME_IN_ONE_PROCESS = ["--dropout", "0", "--drop-path", "0", "--patch-embedding", "shifted"]
# Weights of 2 processes vs 1 after 2 epochs (10 AdamW steps): the all-reduced gradient sums the
# same numbers in another order, a float32 rounding of about 1e-7 of a weight's size (under 1
# here; differences of 1e-8 were seen). Adam moves every weight with a gradient by about the learning rate
# each step, 1e-5 at the least in this run (2.5e-4 peak, cosine to 1 %), so a gradient that
# differs at all (a process training on its own half, a batch split unevenly) shows up 10x or
# more above the tolerance.
WEIGHT_TOLERANCE = 1e-6

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
    result = torchrun("train", "--data", str(shapes_folder), "--out", str(out), "--epochs", "2", *MODEL_FLAGS,
                      *SAME_IN_ONE_PROCESS)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="module")
def single_process_run(shapes_folder, tmp_path_factory):
    """The run of `ddp_run` in one process, without torchrun."""
    out = tmp_path_factory.mktemp("single") / "model"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "vit_hub", "train", "--data", str(shapes_folder), "--out", str(out),
                             "--epochs", "2", *MODEL_FLAGS, *SAME_IN_ONE_PROCESS],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_ddp_training_finishes_and_only_rank0_writes(ddp_run):
    out, result = ddp_run
    files = sorted(path.name for path in out.iterdir())
    assert files == sorted(["README.md", ModelDir.checkpoint, "config.json", "confusion_matrix.png", "curves.png",
                            "metrics.json", "model.safetensors", "inspect.json", "patch_filters.png",
                            "position_similarity.png", "attention_distance.png", ModelDir.samples])
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
    loader = batches.make_loader(batches.Transformed(splits.val, batches.EvalTransform(model.config)), 7,
                               shuffle=False, seed=0, num_workers=0, pin_memory=False)
    single = evaluate(model, loader, torch.device("cpu"), model.config.num_classes)
    assert metrics["final"]["n"] == single["n"] == len(splits.val)
    assert metrics["final"]["accuracy"] == pytest.approx(single["accuracy"], abs=1e-12)
    assert metrics["final"]["loss"] == pytest.approx(single["loss"], rel=1e-5)


def test_two_processes_train_the_model_one_process_trains(ddp_run, single_process_run):
    """The same seed, data and global batches in 2 processes and in 1 give the same weights and
    logits (to the rounding of float sums in another order), and the DDP model's weights
    load in one process under their own names (no `module.` prefix)."""
    from safetensors.torch import load_file

    out, _ = ddp_run
    two, one = load_file(str(ModelDir(out).weights)), load_file(str(ModelDir(single_process_run).weights))
    assert two.keys() == one.keys() and not any(key.startswith("module.") for key in two)
    for name in two:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=WEIGHT_TOLERANCE, msg=name)
    ddp_model, single_model = load_model(out), load_model(single_process_run)
    torch.manual_seed(0)
    pixels = torch.randn(3, ddp_model.config.in_channels, *ddp_model.config.image_size)
    torch.testing.assert_close(ddp_model(pixels).logits, single_model(pixels).logits, rtol=0, atol=1e-5)
    history = [json.loads(ModelDir(path).metrics.read_text())["history"] for path in (out, single_process_run)]
    for ddp_epoch, single_epoch in zip(*history):
        assert ddp_epoch["train_loss"] == pytest.approx(single_epoch["train_loss"], rel=1e-5)


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

    expected, actual = load_file(str(ModelDir(straight).weights)), load_file(str(ModelDir(resumed).weights))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


SHARE_SCRIPT = """
import os, sys
import torch.distributed as dist
from vit_hub.data import sources as vdata
from vit_hub.train.settings import TrainSettings
from vit_hub.train.distributed import start_runtime
from vit_hub.train.run import build_trainer

listed = vdata.index_image_folder
def index_image_folder(root):
    print(f"rank {os.environ['RANK']} lists the folder", flush=True)
    return listed(root)
vdata.index_image_folder = index_image_folder
model = dict(embed_dim=16, depth=1, num_heads=2, image_size=16, patch_size=4)
trainer = build_trainer(TrainSettings(data=sys.argv[1], out=sys.argv[2], device="cpu", num_workers=0, batch_size=8,
                                epochs=1, model=model, seed=3), start_runtime("cpu"))
print(f"rank {os.environ['RANK']}: {len(trainer.data.splits.train)} training images, mean {trainer.plan.config.mean}", flush=True)
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


def test_cpu_threads_come_from_the_free_cores_beside_the_loader_workers(monkeypatch):
    """On a busy machine the intra-op threads are the cores left free, less the loader workers;
    OMP_NUM_THREADS decides when set; the choice is kept for the log."""
    from vit_hub.train.distributed import Runtime, choose_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    try:
        for load, workers, processes, expected in ((0.4, 2, 1, 6), (5.7, 1, 1, 2), (9.0, 2, 1, 1), (0.0, 1, 2, 3)):
            monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
            runtime = Runtime(torch.device("cpu"), local_world_size=processes)
            choose_cpu_threads(runtime, workers)
            assert torch.get_num_threads() == expected, (load, workers, processes)
            assert runtime.threads.startswith(f"{expected} intra-op thread(s) per process")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        runtime = Runtime(torch.device("cpu"))
        choose_cpu_threads(runtime, 1)
        assert torch.get_num_threads() == expected and "OMP_NUM_THREADS" in runtime.threads
    finally:
        torch.set_num_threads(before)
