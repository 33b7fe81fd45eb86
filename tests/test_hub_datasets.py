"""`--data` as a Hugging Face dataset (vit_hub/data/hub_datasets.py): what save_to_disk writes,
parquet shards in the Hub's layout beside a README, and such a dataset on the Hub found in a
filled cache with HF_HUB_OFFLINE=1, generated here: read with their class names and splits,
trained on through `vit-hub train` (the card naming a Hub dataset by id), the same rows as a
folder of the same images; bad datasets refused in one line."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import CLASSES, TINY_TRAIN_FLAGS, assert_one_line, draw_example
from vit_hub.data.hub_datasets import DatasetOptions, HubImages
from vit_hub.data.sources import Split, load_splits, targets_of
from vit_hub.errors import DataError
from vit_hub.model.config import ViTConfig

ROOT = Path(__file__).resolve().parents[1]
LABELS = list(CLASSES)


def rows(count: int, seed: int) -> dict[str, list]:
    """`count` generated photos per class: {"image": PIL images, "label": class indices}."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for index, name in enumerate(LABELS):
        for _ in range(count):
            images.append(draw_example(name, (int(rng.integers(20, 48)), int(rng.integers(20, 48))), rng))
            labels.append(index)
    return {"image": images, "label": labels}


def dataset(count: int, seed: int, **features) -> datasets.Dataset:
    kinds = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=LABELS), **features})
    return datasets.Dataset.from_dict(rows(count, seed), features=kinds)


@pytest.fixture(scope="module")
def splits() -> datasets.DatasetDict:
    return datasets.DatasetDict(train=dataset(16, 0), test=dataset(6, 1))


@pytest.fixture(scope="module")
def saved(splits, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved") / "shapes"
    splits.save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def hub_layout(splits, tmp_path_factory) -> Path:
    """Parquet shards named as push_to_hub names them, two for train, and a dataset card."""
    folder = tmp_path_factory.mktemp("hub") / "shapes"
    (folder / "data").mkdir(parents=True)
    halves = splits["train"].train_test_split(test_size=0.5, seed=0)
    for number, part in enumerate((halves["train"], halves["test"])):
        part.to_parquet(str(folder / "data" / f"train-{number:05d}-of-00002.parquet"))
    splits["test"].to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# shapes\n")
    return folder


@pytest.mark.parametrize("layout", ["saved", "hub_layout"])
def test_a_dataset_folder_gives_its_classes_splits_and_images(layout, request, splits):
    loaded = load_splits(str(request.getfixturevalue(layout)), val_split=0.25, seed=0)
    assert loaded.labels == LABELS and "Hugging Face dataset" in loaded.source
    assert len(loaded.train) + len(loaded.val) == 32 and len(loaded.test) == 12
    assert sorted(targets_of(loaded.test).tolist()) == sorted(splits["test"]["label"])
    image, label = loaded.test[0]
    assert label in (0, 1) and image.size[0] >= 20


def test_vit_hub_train_trains_on_a_dataset_folder_through_the_command(hub_layout, tmp_path):
    out = tmp_path / "model"
    done = subprocess.run([sys.executable, "-m", "vit_hub", "train", "--data", str(hub_layout), "--out", str(out),
                           "--epochs", "2", *TINY_TRAIN_FLAGS], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["labels"] == LABELS
    final = json.loads((out / "metrics.json").read_text())["final"]
    assert final["split"] == "test" and final["n"] == 12


def test_the_same_images_as_a_folder_and_as_a_dataset_are_the_same_rows(saved, tmp_path):
    """Written out as class folders (PNG, lossless), the dataset's images and labels are the folder's."""
    for part in ("train", "test"):
        loaded = datasets.load_from_disk(str(saved))[part]
        for index, row in enumerate(loaded):
            target = tmp_path / part / LABELS[row["label"]] / f"{index:03d}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            row["image"].save(target)
    as_folder = load_splits(str(tmp_path), val_split=0)
    as_dataset = load_splits(str(saved), val_split=0)
    assert as_folder.labels == as_dataset.labels
    pixels = lambda split: sorted(np.asarray(image).tobytes() + bytes([label]) for image, label in split)  # noqa: E731
    assert pixels(as_folder.test) == pixels(as_dataset.test)


def test_a_dataset_without_a_class_label_column_is_refused_in_one_line(tmp_path):
    plain = datasets.Dataset.from_dict({"image": rows(2, 0)["image"], "label": ["a", "b", "a", "b"]},
                                       features=datasets.Features({"image": datasets.Image(),
                                                                   "label": datasets.Value("string")}))
    plain.save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(Exception) as refused:
        load_splits(str(tmp_path / "plain"))
    assert_one_line(str(refused.value), "expected one image column", "label (Value)")


def test_a_dataset_of_one_class_is_refused_in_one_line(tmp_path):
    one = datasets.Dataset.from_dict(
        {"image": rows(2, 0)["image"][:2], "label": [0, 0]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["only"])}))
    one.save_to_disk(str(tmp_path / "one"))
    with pytest.raises(Exception) as refused:
        load_splits(str(tmp_path / "one"))
    assert_one_line(str(refused.value), "expected at least two classes")


def test_an_image_that_does_not_decode_is_skipped_as_a_folders_file_is(tmp_path):
    good = io.BytesIO()
    rows(1, 0)["image"][0].save(good, format="PNG")
    broken = datasets.Dataset.from_dict(
        {"image": [{"bytes": b"\x89PNG\r\n\x1a\n cut", "path": None}, {"bytes": good.getvalue(), "path": None}],
         "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=LABELS)}))
    broken.save_to_disk(str(tmp_path / "broken"))
    loaded = load_splits(str(tmp_path / "broken"), val_split=0)
    image, label = loaded.train[0]  # row 0 does not decode: the next one of its split stands in
    assert label == 1 and image.size == rows(1, 0)["image"][0].size


# A dataset on the Hub, from a filled cache ----------------------------------------------------
def filled_cache(hub_layout: Path, cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """The Hugging Face cache as snapshot_download leaves it after fetching `repo_id` at main."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(hub_layout, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


def train_offline(data: str, out: Path, cache: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "vit_hub", "train", "--data", data, "--out", str(out), "--epochs", "1",
                           *TINY_TRAIN_FLAGS, *flags], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_a_hub_dataset_id_trains_from_the_cache_offline_and_the_card_names_it(hub_layout, tmp_path):
    cache = filled_cache(hub_layout, tmp_path / "cache", "someone/shapes")
    done = train_offline("hf://datasets/someone/shapes", tmp_path / "model", cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "someone/shapes (Hugging Face dataset)" in done.stdout + done.stderr
    front = (tmp_path / "model" / "README.md").read_text().split("---")[1]
    assert "datasets:\n- someone/shapes" in front


@pytest.mark.parametrize("data, fragment", [
    ("hf://datasets/someone/missing", "expected the Hub dataset someone/missing"),
    ("hf://datasets/not-a-repo-id", "expected hf://datasets/OWNER/NAME"),
])
def test_a_hub_dataset_that_is_not_there_offline_is_one_line(data, fragment, tmp_path):
    done = train_offline(data, tmp_path / "model", tmp_path / "empty-cache")
    assert done.returncode != 0 and not (tmp_path / "model" / "model.safetensors").exists()
    assert_one_line(done.stderr.strip().splitlines()[-1].removeprefix("error: "), fragment)


def test_an_image_that_names_a_file_is_never_opened(tmp_path):
    """A dataset is untrusted: a row whose image is a path (here to a real PNG) and no bytes is
    skipped as unreadable; the file it names is never read."""
    elsewhere = tmp_path / "elsewhere.png"
    rows(1, 0)["image"][0].save(elsewhere)
    good = io.BytesIO()
    rows(1, 1)["image"][1].save(good, format="PNG")
    pointing = datasets.Dataset.from_dict(
        {"image": [{"bytes": None, "path": str(elsewhere)}, {"bytes": good.getvalue(), "path": None}],
         "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=LABELS)}))
    split = Split(HubImages(pointing, "image", "label"))  # in memory: save_to_disk would embed the file's bytes
    assert [label for _, label in (split[0], split[1])] == [1, 1]


# Configs and columns named by flags ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_configs(splits, tmp_path_factory) -> Path:
    """A dataset with two configs, each in a folder of its own, as push_to_hub(config_name=...) writes them."""
    folder = tmp_path_factory.mktemp("configs") / "shapes"
    for config, rows_kept in (("small", 8), ("full", 32)):
        (folder / config).mkdir(parents=True)
        splits["train"].select(range(rows_kept)).to_parquet(str(folder / config / "train-00000-of-00001.parquet"))
        splits["test"].to_parquet(str(folder / config / "test-00000-of-00001.parquet"))
    (folder / "README.md").write_text("# shapes, two configs\n")
    return folder


def test_a_config_is_picked_by_data_config_and_one_is_needed_where_there_are_several(two_configs):
    small = load_splits(str(two_configs), val_split=0, options=DatasetOptions(config="small"))
    full = load_splits(str(two_configs), val_split=0, options=DatasetOptions(config="full"))
    assert (len(small.train), len(full.train)) == (8, 32) and small.labels == LABELS
    with pytest.raises(DataError) as refused:
        load_splits(str(two_configs))
    assert_one_line(str(refused.value), "its configs: full, small (give one with --data-config)")
    with pytest.raises(DataError) as refused:
        load_splits(str(two_configs), options=DatasetOptions(config="huge"))
    assert_one_line(str(refused.value), "expected a config folder huge/", "its configs: full, small")
    with pytest.raises(DataError) as refused:
        DatasetOptions(config="../elsewhere")
    assert_one_line(str(refused.value), "--data-config '../elsewhere': expected a config's name")


@pytest.fixture(scope="module")
def two_image_columns(tmp_path_factory) -> Path:
    """Two Image columns, a ClassLabel and a plain integer column: the features alone do not tell."""
    made = rows(4, 2)
    kinds = datasets.Features({"photo": datasets.Image(), "mask": datasets.Image(),
                               "kind": datasets.ClassLabel(names=LABELS), "count": datasets.Value("int64")})
    folder = tmp_path_factory.mktemp("columns") / "photos"
    datasets.Dataset.from_dict({"photo": made["image"], "mask": made["image"][::-1], "kind": made["label"],
                                "count": made["label"]}, features=kinds).save_to_disk(str(folder))
    return folder


def test_image_and_label_columns_named_by_flags(two_image_columns):
    with pytest.raises(DataError) as refused:
        load_splits(str(two_image_columns), val_split=0)
    assert_one_line(str(refused.value), "or --image-column / --label-column naming them", "mask (Image)")
    photos = load_splits(str(two_image_columns), val_split=0, options=DatasetOptions(image_column="photo"))
    masks = load_splits(str(two_image_columns), val_split=0,
                        options=DatasetOptions(image_column="mask", label_column="kind"))
    assert photos.labels == LABELS and len(photos.train) == 8
    assert np.array_equal(np.asarray(photos.train[0][0]), np.asarray(masks.train[7][0]))


@pytest.mark.parametrize("options, fragment", [
    (DatasetOptions(image_column="kind"), "--image-column kind: expected an Image feature, found ClassLabel"),
    (DatasetOptions(image_column="photo", label_column="count"),
     "--label-column count: expected a ClassLabel, which names the classes, found Value"),
    (DatasetOptions(image_column="picture"), "--image-column picture: expected a column of --data photos, found photo"),
])
def test_a_column_of_the_wrong_kind_is_refused_in_one_line(two_image_columns, options, fragment):
    with pytest.raises(DataError) as refused:
        load_splits(str(two_image_columns), val_split=0, options=options)
    assert_one_line(str(refused.value), fragment)


def test_dataset_flags_with_an_image_folder_are_refused_in_one_line(image_folder):
    with pytest.raises(DataError) as refused:
        load_splits(str(image_folder), options=DatasetOptions(image_column="image"))
    assert_one_line(str(refused.value), "--image-column image: expected --data to be a Hugging Face dataset")


def test_a_config_of_a_hub_dataset_trains_offline_and_the_card_names_a_local_dataset_by_its_folder(
        two_configs, hub_layout, tmp_path):
    cache = filled_cache(two_configs, tmp_path / "cache", "someone/configs")
    done = train_offline("hf://datasets/someone/configs", tmp_path / "model", cache, "--data-config", "small")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "model" / "metrics.json").read_text())["settings"]["data_config"] == "small"
    from vit_hub.hub.card import card_metadata
    config = ViTConfig.from_dict(json.loads((tmp_path / "model" / "config.json").read_text()))
    local = card_metadata(config, {"settings": {"data": str(hub_layout)},
                                                                  "final": {"split": "test", "accuracy": 0.5}}, "m")
    assert (local.eval_results[0].dataset_name, local.eval_results[0].dataset_type) == ("shapes", "parquet")


@pytest.mark.slow
def test_the_same_images_as_a_folder_and_as_a_dataset_train_the_same_model(saved, tmp_path):
    """Rows in class order written as class folders whose file names sort as the rows do: sample i
    is the same image in both, so the seeded validation split, the order of every epoch and each
    sample's augmentation (seed, epoch, index) are the same, and so is every weight."""
    folder = tmp_path / "folder"
    for part in ("train", "test"):
        for index, row in enumerate(datasets.load_from_disk(str(saved))[part]):
            target = folder / part / LABELS[row["label"]] / f"{index:03d}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            row["image"].save(target)
    trained = {}
    for name, data in (("folder", folder), ("dataset", saved)):
        done = subprocess.run([sys.executable, "-m", "vit_hub", "train", "--data", str(data), "--out",
                               str(tmp_path / f"{name}-model"), "--epochs", "2", *TINY_TRAIN_FLAGS,
                               "--augment", "photos"],
                              capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        trained[name] = (load_file(str(tmp_path / f"{name}-model" / "model.safetensors")),
                         json.loads((tmp_path / f"{name}-model" / "metrics.json").read_text())["final"])
    (folder_weights, folder_final), (dataset_weights, dataset_final) = trained["folder"], trained["dataset"]
    assert sorted(folder_weights) == sorted(dataset_weights)
    assert all(torch.equal(folder_weights[name], dataset_weights[name]) for name in folder_weights)
    assert folder_final["accuracy"] == dataset_final["accuracy"] and folder_final["n"] == dataset_final["n"] == 12
