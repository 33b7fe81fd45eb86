"""Streamed training data (vit_hub/data/streams.py, vit_hub/train/streaming.py): parquet shards
with --stream and WebDataset tar shards, generated here. Each image read once per epoch across
torchrun processes and their loader workers; a streamed run killed within an epoch and resumed
ends with the weights of the run that was not killed."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import CLASSES, TINY_MODEL, TINY_RUN, assert_one_line, draw_example, free_port
from vit_hub.data.hub_datasets import DatasetOptions
from vit_hub.data.sources import load_splits
from vit_hub.data.streams import StreamedTraining, process_batches, worker_batches
from vit_hub.errors import DataError
from vit_hub.train.settings import TrainSettings

ROOT = Path(__file__).resolve().parents[1]
LABELS = list(CLASSES)


def photos(count: int, seed: int) -> tuple[list, list[int]]:
    """`count` small generated photos per class, in class order, and their class indices."""
    rng = np.random.default_rng(seed)
    images = [draw_example(name, (20, 20), rng) for name in LABELS for _ in range(count)]
    return images, [index for index in range(len(LABELS)) for _ in range(count)]


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def png(image) -> bytes:
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    return encoded.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The same 48 training and 12 test images twice: parquet shards in the Hub's layout (3
    training shards of row groups of 5 rows) in parquet/, WebDataset tar shards in tar/."""
    root = tmp_path_factory.mktemp("streams")
    (root / "parquet" / "data").mkdir(parents=True)
    (root / "tar").mkdir()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=LABELS)})
    for split, count, parts in (("train", 24, 3), ("test", 6, 1)):
        images, labels = photos(count, seed=len(split))
        rows = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
        for part in range(parts):
            piece = rows.shard(parts, part, contiguous=True)
            name = f"{split}-{part:05d}-of-{parts:05d}.parquet"
            piece.to_parquet(str(root / "parquet" / "data" / name), batch_size=5)
            write_tar(root / "tar" / f"{split}-{part:06d}.tar",
                      [(f"{part}_{row:04d}.{kind}", data) for row, example in enumerate(piece)
                       for kind, data in (("png", png(example["image"])), ("cls", str(example["label"]).encode()))])
    return root


def test_every_position_of_an_epoch_goes_to_one_process_and_worker_once():
    """For any processes, workers and step a loader starts at: the batches of all of them, in the
    order each DataLoader takes them (worker (j - start) % workers makes its j-th), cover the
    rest of the epoch once; every process takes the same number of steps."""
    for size, batch in ((96, 8), (100, 8), (5, 8)):
        for world in (1, 2, 4):
            parts = [process_batches(size, batch, rank, world) for rank in range(world)]
            assert len({len(part) for part in parts}) == 1
            used = size // batch * batch if size >= batch else size
            assert sorted(p for part in parts for start, stop in part for p in range(start, stop)) == list(range(used))
            for workers in (1, 2, 3):
                for start in (0, 1, len(parts[0]) - 1):
                    runs = [worker_batches(parts[0], workers, worker, start) for worker in range(workers)]
                    taken = [runs[turn % workers][turn // workers] for turn in range(len(parts[0]) - start)]
                    assert sum(map(len, runs)) == len(taken)
                    assert sorted(taken) == parts[0][start:]  # each batch of the rest once
                    for run in runs:  # each worker's batches: one contiguous run of the order
                        assert all(a[1] == b[0] for a, b in zip(run, run[1:]))


@pytest.mark.parametrize("layout, options", [("parquet", DatasetOptions(stream=True)), ("tar", DatasetOptions())])
def test_shards_give_their_classes_splits_and_images(shards, layout, options):
    loaded = load_splits(str(shards / layout), val_split=0.25, seed=0, options=options)
    assert loaded.streamed and loaded.labels == (LABELS if layout == "parquet" else ["0", "1"])
    assert len(loaded.train) + len(loaded.val) == 48 and len(loaded.test) == 12
    images, labels = photos(6, seed=4)
    assert [loaded.test[index][1] for index in range(12)] == labels
    assert np.array_equal(np.asarray(loaded.test[7][0]), np.asarray(images[7].convert("RGB")))


def test_tar_shards_skip_links_and_refuse_a_class_that_is_not_a_number(shards, tmp_path):
    images, _ = photos(2, seed=0)
    members = [("a.png", png(images[0])), ("a.cls", b"0"), ("b.png", png(images[2])), ("b.cls", b"1")]
    write_tar(tmp_path / "train-000000.tar", members)
    with tarfile.open(tmp_path / "train-000000.tar", "a") as archive:  # a link to a file elsewhere: never read
        link = tarfile.TarInfo("c.png")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
        archive.addfile(*_sized("c.cls", b"1"))
    loaded = load_splits(str(tmp_path), val_split=0)
    assert len(loaded.train) == 2 and loaded.train[1][1] == 1
    write_tar(tmp_path / "train-000000.tar", [("a.png", png(images[0])), ("a.cls", b"disc")])
    with pytest.raises(DataError) as refused:
        load_splits(str(tmp_path), val_split=0)
    assert_one_line(str(refused.value), "expected a class number in a.cls of train-000000.tar, found 'disc'")


def _sized(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, io.BytesIO(data)


SEEN = """
import json, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from vit_hub.data.sources import load_splits
from vit_hub.data.streams import StreamedTraining
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
train = load_splits(sys.argv[1], val_split=0.25, seed=0).train
stream = StreamedTraining(train.dataset, train.indices, 0, 8, rank, world, lambda epoch, index, image, label: index)
epochs = []
for epoch in range(2):
    stream.set_epoch(epoch)
    batches = [batch.tolist() for batch in DataLoader(stream, batch_size=8 // world, num_workers=2)]
    everyone = [None] * world
    dist.all_gather_object(everyone, batches)
    epochs.append(everyone)
if rank == 0:
    print(json.dumps({"epochs": epochs, "train": list(map(int, train.indices))}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_with_two_workers_each_read_every_training_image_once_per_epoch(shards, tmp_path):
    script = tmp_path / "seen.py"
    script.write_text(SEEN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(script), str(shards / "tar")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["train"]) == 36  # 48 less the 12 held out for validation
    orders = []
    for processes in seen["epochs"]:
        assert [len(batches) for batches in processes] == [36 // 8] * 2  # the same steps on both
        read = [index for batches in processes for batch in batches for index in batch]
        assert len(read) == len(set(read)) == 32 and set(read) <= set(seen["train"])  # 4 whole batches of 8, once
        orders.append(read)
    assert orders[0] != orders[1]


def train_streamed(data: Path, out: Path, **overrides) -> Path:
    from vit_hub.train.run import train

    settings = TrainSettings(data=str(data), out=str(out), model=dict(TINY_MODEL), epochs=2,
                             **{**TINY_RUN, "batch_size": 4, "augment": "photos", "num_workers": 2}, stream=True,
                             checkpoint_steps=3)
    train(dataclasses.replace(settings, **overrides))
    return out


@pytest.mark.slow
def test_a_streamed_run_killed_within_an_epoch_and_resumed_ends_with_the_uninterrupted_weights(shards, tmp_path,
                                                                                             monkeypatch):
    whole = train_streamed(shards / "parquet", tmp_path / "whole")
    from vit_hub.train import step

    update, calls = step.TrainStep.update, []

    def killed_at_step_16(self, images, labels):  # 44 images, 11 steps an epoch: step 5 of the second
        calls.append(1)
        if len(calls) == 16:
            raise KeyboardInterrupt
        return update(self, images, labels)

    monkeypatch.setattr(step.TrainStep, "update", killed_at_step_16)
    with pytest.raises(KeyboardInterrupt):
        train_streamed(shards / "parquet", tmp_path / "killed")
    monkeypatch.setattr(step.TrainStep, "update", update)
    from vit_hub.train.checkpoint import read_checkpoint_state

    state = read_checkpoint_state(tmp_path / "killed")
    assert (state["epoch"], state["step_in_epoch"]) == (1, 3)  # the checkpoint after 3 of epoch 2's steps
    from vit_hub.train.run import train

    train(TrainSettings(data="", out=str(tmp_path / "killed")), resume=True)
    first = load_file(str(whole / "model.safetensors"))
    second = load_file(str(tmp_path / "killed" / "model.safetensors"))
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_the_card_names_local_tar_shards_by_their_folder_and_format(shards):
    from conftest import tiny_config
    from vit_hub.hub.card import card_metadata
    from vit_hub.model.config import ViTConfig

    metrics = {"settings": {"data": str(shards / "tar")}, "final": {"split": "test", "accuracy": 0.5}}
    result = card_metadata(ViTConfig(**tiny_config()), metrics, "m").eval_results[0]
    assert (result.dataset_name, result.dataset_type) == ("tar", "webdataset")


def test_a_hub_dataset_streamed_is_listed_and_read_by_ranges_without_a_download(shards, tmp_path, monkeypatch):
    """hf://datasets/OWNER/NAME with --stream: the shards are listed and read through
    huggingface_hub's HfFileSystem (here a file system over a local folder in the Hub's layout,
    as the Hub serves it), none fetched into the cache."""
    import shutil

    import huggingface_hub
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    shutil.copytree(shards / "parquet", tmp_path / "hub" / "datasets" / "someone" / "shapes")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub, "HfFileSystem",
                        lambda: DirFileSystem(path=str(tmp_path / "hub"), fs=LocalFileSystem()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    loaded = load_splits("hf://datasets/someone/shapes", val_split=0, options=DatasetOptions(stream=True))
    assert loaded.streamed and loaded.labels == LABELS and (len(loaded.train), len(loaded.test)) == (48, 12)
    assert all(isinstance(shard, str) for shard in loaded.train.dataset.shards)
    images, labels = photos(6, seed=4)
    assert np.array_equal(np.asarray(loaded.test[7][0]), np.asarray(images[7].convert("RGB")))
    stream = StreamedTraining(loaded.train.dataset, loaded.train.indices, 0, 8, 0, 1, lambda *sample: sample[1])
    assert sorted(stream) == list(range(48))  # every training row read once, block by block
    assert not (tmp_path / "cache").exists()
