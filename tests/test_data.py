"""Data sources, splits, statistics and the pixels every path feeds the model."""

from __future__ import annotations

import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from scipy import ndimage

from conftest import CLASSES, in_mode, tiny_config, write_class_folders
from vit_hub.data import augmentation, batches, folders
from vit_hub.data.augmentation import TrainTransform, resolve_augment
from vit_hub.data.batch_augmentation import ERASE, unaugmented_draws
from vit_hub.data.batches import EvalTransform, Transformed, make_loader
from vit_hub.data.sources import (DataSplits, compute_mean_std, describe_images, load_splits, stratified_split,
                                  targets_of)
from vit_hub.errors import DataError
from vit_hub.model.config import ViTConfig
from vit_hub.processing.preprocess import preprocess, preprocess_batch
from vit_hub.train.distributed import Runtime
from vit_hub.train.loaders import RunLoaders, build_loaders
from vit_hub.train.schedule import Schedule
from vit_hub.train.settings import TrainSettings

LABELS = sorted(CLASSES)


def identity_config(channels: int = 3, **overrides) -> ViTConfig:
    """A config whose normalisation is the identity on [0, 1] pixels (mean 0, std 1)."""
    return ViTConfig(**tiny_config(in_channels=channels, mean=0.0, std=1.0, **overrides))


def image_files(root):
    return sorted(path for path in root.rglob("*") if path.suffix in (".png", ".jpg") and path.name != "corrupt.png")


# Image folders ------------------------------------------------------------------------------
def test_folder_is_listed_without_reading_and_the_corrupt_file_reported_when_met(image_folder, corrupt_file,
                                                                                 capsys, monkeypatch):
    opened = []
    monkeypatch.setattr(folders, "open_image", lambda path, name=None: opened.append(path) or Image.new("L", (4, 4)))
    splits = load_splits(str(image_folder), val_split=0.25, seed=0)
    assert opened == [] and splits.skipped == [] and splits.skipped_report() is None  # listed, not read
    monkeypatch.undo()
    assert splits.labels == LABELS and splits.test is None
    # 25 image files in bright_disc (one corrupt), 24 in dark_square; a quarter of each class held out
    assert np.bincount(targets_of(splits.val)).tolist() == [6, 6]
    assert np.bincount(targets_of(splits.train)).tolist() == [19, 18]
    assert not set(splits.train.indices) & set(splits.val.indices)
    for split in (splits.train, splits.val):
        assert all(isinstance(image, Image.Image) and label in (0, 1) for image, label in split)
    assert splits.skipped == [str(corrupt_file)]
    assert splits.skipped_report() == (f"skipped 1 unreadable image(s) (use --strict to fail instead):\n"
                                       f"  {corrupt_file}")
    assert capsys.readouterr() == ("", "")  # library code reports by returning; the CLI prints


def test_an_unreadable_image_is_replaced_by_the_next_image_of_its_own_split(image_folder, corrupt_file):
    splits = load_splits(str(image_folder), val_split=0.25, seed=0)
    paths = [path for path, _ in splits.train.samples]
    position = paths.index(str(corrupt_file))
    image, label = splits.train[position]
    following = paths[(position + 1) % len(paths)]
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(following)))
    assert label == splits.train.samples[(position + 1) % len(paths)][1]
    assert str(corrupt_file) not in [path for path, _ in splits.val.samples]


def test_strict_fails_on_the_corrupt_file_naming_it_when_read(image_folder, corrupt_file):
    splits = load_splits(str(image_folder), strict=True, val_split=0.0)  # listing reads nothing
    with pytest.raises(DataError, match=f"unreadable image {corrupt_file}") as raised:
        [splits.train[index] for index in range(len(splits.train))]
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("strict", [False, True])
def test_files_that_loader_workers_cannot_read_reach_the_main_process(image_folder, corrupt_file, strict):
    splits = load_splits(str(image_folder), strict=strict, val_split=0.0)
    dataset = Transformed(splits.train, EvalTransform(identity_config()))
    loader = make_loader(dataset, 8, shuffle=False, seed=0, num_workers=2, pin_memory=False)
    assert sum(len(labels) for _, labels in loader) == len(splits.train) == 49  # the corrupt one replaced
    assert splits.skipped == [str(corrupt_file)]
    if strict:  # the worker carries on; the main process fails in one line at its next check
        with pytest.raises(DataError, match=f"unreadable image {corrupt_file} .*is not a readable image"):
            splits.check_unreadable()
    else:
        splits.check_unreadable()


def test_folders_are_listed_in_imagefolders_order(split_image_folder):
    from torchvision.datasets import ImageFolder

    index = folders.index_image_folder(split_image_folder)
    for part in ("train", "test"):
        reference = ImageFolder(str(split_image_folder / part), allow_empty=True)
        assert index.parts[part] == reference.samples and index.classes == reference.classes


def test_split_depends_only_on_the_seed(image_folder):
    first = load_splits(str(image_folder), val_split=0.25, seed=3)
    again = load_splits(str(image_folder), val_split=0.25, seed=3)
    other = load_splits(str(image_folder), val_split=0.25, seed=4)
    assert first.val.indices == again.val.indices
    assert first.val.indices != other.val.indices


def test_train_and_test_subfolders_are_used_and_val_carved_from_train(split_image_folder):
    splits = load_splits(str(split_image_folder), val_split=0.25, seed=0)
    assert splits.labels == LABELS and splits.skipped == []
    assert np.bincount(targets_of(splits.test)).tolist() == [8, 8]
    assert np.bincount(targets_of(splits.val)).tolist() == [4, 4]
    assert len(splits.train) == 24
    assert splits.split("test") is splits.test


def test_without_val_split_the_test_split_selects(split_image_folder):
    splits = load_splits(str(split_image_folder), val_split=0.0)
    assert splits.val is splits.test and len(splits.train) == 32


def test_val_folder_is_used_as_given(tmp_path):
    write_class_folders(tmp_path / "train", per_class=4, seed=0)
    write_class_folders(tmp_path / "val", per_class=2, seed=1)
    splits = load_splits(str(tmp_path), val_split=0.5)
    assert len(splits.train) == 8 and len(splits.val) == 4 and splits.test is None
    with pytest.raises(DataError, match=r"split 'test' is not available .* expected one of \['train', 'val'\]"):
        splits.split("test")


def test_hidden_folders_are_not_classes_and_extensions_ignore_case(tmp_path):
    files = write_class_folders(tmp_path, per_class=2, seed=0)
    files[0].rename(files[0].with_suffix(".PNG"))
    (tmp_path / ".ipynb_checkpoints").mkdir()
    files[1].rename(tmp_path / ".ipynb_checkpoints" / files[1].name)
    splits = load_splits(str(tmp_path), val_split=0.0)
    assert splits.labels == LABELS
    assert sorted(Path(path).name for path, _ in splits.train.samples) == sorted(
        [files[0].with_suffix(".PNG").name] + [path.name for path in files[2:]])


def test_test_folder_with_a_class_train_lacks_is_an_error(tmp_path):
    write_class_folders(tmp_path / "train", per_class=2, seed=0)
    write_class_folders(tmp_path / "test", per_class=1, seed=1)
    (tmp_path / "test" / "zebra").mkdir()
    with pytest.raises(DataError, match=r"has classes \['zebra'\] that the training folder does not have"):
        load_splits(str(tmp_path))


def one_class(root):
    write_class_folders(root, per_class=2, seed=0)
    for path in (root / "dark_square").iterdir():
        path.unlink()
    (root / "dark_square").rmdir()


def no_images(root):
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "readme.txt").write_text("no images here")


def one_empty_class(root):
    write_class_folders(root, per_class=2, seed=0)
    (root / "zebra").mkdir()


def only_corrupt_images(root):
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        (root / name / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")


def read_first_image(root):
    return load_splits(str(root), val_split=0.0).train[0]


@pytest.mark.parametrize("make, message", [
    (lambda root: None, r"expected a folder of images, 'mnist', or a torchvision dataset name .* \(no such folder\)"),
    (lambda root: root.mkdir(), r"expected class subfolders in .* \(ImageFolder layout"),
    (lambda root: (root.mkdir(), (root / "x.png").write_bytes(b"")), "expected class subfolders in"),
    (one_class, r"expected at least 2 classes in .*, found 1: \['bright_disc'\]"),
    (no_images, "found no readable images in"),
    (one_empty_class, r"class folders \['zebra'\] in .* have no readable images"),
    (only_corrupt_images, "found no readable images among the 2 files of this split"),
], ids=["missing", "empty", "no-class-folders", "one-class", "no-images", "empty-class", "all-corrupt"])
def test_unusable_folders_give_one_clear_error(tmp_path, make, message):
    root = tmp_path / "data"
    make(root)
    with pytest.raises(DataError, match=message) as raised:
        read_first_image(root)  # listing finds all but the last; reading finds that one
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name, dataset_class", [
    ("cifar10", "CIFAR10"), ("svhn", "SVHN"), ("Fashion-MNIST", "FashionMNIST"),
])
def test_torchvision_dataset_missing_under_data_root(tmp_path, name, dataset_class):
    with pytest.raises(DataError, match=f"expected torchvision's {dataset_class} files under --data-root {tmp_path}"
                                        r" \(this tool never downloads\)"):
        load_splits(name, data_root=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing was downloaded


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_val_split_must_be_a_fraction(image_folder, fraction):
    with pytest.raises(DataError, match=r"--val-split: expected a fraction in \[0, 1\)"):
        load_splits(str(image_folder), val_split=fraction)


def test_bundled_mnist_loads_offline():
    splits = load_splits("mnist", val_split=0.1, seed=0)
    assert splits.labels == [str(digit) for digit in range(10)]
    assert len(splits.train) + len(splits.val) == 60_000 and len(splits.test) == 10_000
    assert abs(len(splits.val) - 6_000) <= 5  # a tenth of each digit, rounded per digit
    image, label = splits.test[0]
    assert image.size == (28, 28) and image.mode == "L" and label == 7
    shares = np.bincount(targets_of(splits.val)) / np.bincount(targets_of(splits.train) )
    assert np.allclose(shares, 1 / 9, atol=0.002)  # stratified: a tenth of every digit


# Splitting and statistics ----------------------------------------------------------------------
class Labels(torch.utils.data.Dataset):
    def __init__(self, targets):
        self.targets = list(targets)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return index, self.targets[index]


def test_stratified_split_keeps_every_class_on_both_sides():
    dataset = Labels([0] * 50 + [1] * 10 + [2] * 2 + [3])
    train, held = stratified_split(dataset, 0.2, seed=0)
    assert np.bincount(targets_of(held), minlength=4).tolist() == [10, 2, 1, 0]  # the singleton stays in train
    assert sorted(train.indices + held.indices) == list(range(len(dataset)))


def test_stratified_split_of_singletons_is_an_error():
    with pytest.raises(DataError, match="leaves no validation images out of 3"):
        stratified_split(Labels([0, 1, 2]), 0.5, seed=0)


class Images(torch.utils.data.Dataset):
    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], 0


def test_mean_and_std_are_measured_as_the_model_sees_the_pixels():
    black, white = Image.new("L", (40, 20), 0), Image.new("L", (8, 8), 255)
    mean, std = compute_mean_std(Images([black, white]), identity_config(channels=1))
    assert (mean, std) == ([0.5], [0.5])
    red = Image.new("RGB", (10, 30), (255, 0, 51))
    mean, std = compute_mean_std(Images([red, red]), identity_config())
    assert mean == [1.0, 0.0, 0.2]
    assert min(std) > 0  # a constant channel still gives a usable std


class DecodedPhotos(torch.utils.data.Dataset):
    """Images made when read, as a folder decodes its files, counting how many are alive at once."""

    def __init__(self, count: int):
        self.count, self.alive, self.most_alive = count, 0, 0

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        image = Image.new("RGB", (64, 48), (index % 256, 90, 160))
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(image, self._dropped)
        return image, index % 2

    def _dropped(self):
        self.alive -= 1


@pytest.mark.parametrize("measure", ["describe_images", "compute_mean_std"])
def test_the_data_is_measured_one_image_at_a_time(measure):
    """A folder of phone photos takes 36 MB an image decoded: measuring 400 (or up to 5,000)
    of them must not hold them all, as it did (40 photos of 12 MP: 1.7 GB more at the peak)."""
    photos = DecodedPhotos(50)
    if measure == "describe_images":
        stats = describe_images(photos, count=40)
        assert stats.channels == 3 and stats.median_side == 48
    else:
        mean, _ = compute_mean_std(photos, identity_config(), max_images=40)
        assert mean[1:] == [round(90 / 255, 4), round(160 / 255, 4)]
    assert photos.most_alive <= 2  # the one being read and the one before it


def test_describe_images_reports_channels_and_typical_size(image_folder):
    stats = describe_images(load_splits(str(image_folder)).train)
    assert stats.channels == 3 and 18 <= stats.median_side <= 55 and stats.num_train == 45
    gray = describe_images(Images([Image.new("L", (30, 40)), Image.new("I;16", (50, 60))]))
    assert (gray.channels, gray.median_side, gray.num_train) == (1, 40, 2)


# Pixels: preprocessing, transforms and their parity -------------------------------------------------
@pytest.mark.parametrize("channels", [1, 3])
def test_training_and_evaluation_datasets_see_the_same_pixels_as_preprocess(split_image_folder, channels):
    """What the trainer feeds (unaugmented) and evaluates equals what inference computes from the file."""
    config = ViTConfig(**tiny_config(in_channels=channels, image_size=[16, 24], mean=0.4, std=0.2))
    splits = load_splits(str(split_image_folder), val_split=0.0)
    pairs = [(Transformed(splits.train, TrainTransform(config, augment="none")), splits.train),
             (Transformed(splits.test, EvalTransform(config)), splits.test)]
    for dataset, folder in pairs:
        for index, (path, label) in enumerate(folder.samples):
            pixels, loaded_label = dataset[index]
            assert loaded_label == label and pixels.shape == (channels, 16, 24) and pixels.dtype == torch.float32
            assert torch.equal(pixels, torch.from_numpy(preprocess(path, config))), path


def test_folder_images_keep_their_own_mode(split_image_folder):
    splits = load_splits(str(split_image_folder), val_split=0.0)
    modes = {splits.train[index][0].mode for index in range(len(splits.train))}
    assert modes == {"RGB", "L", "RGBA", "P", "I;16", "CMYK"}  # converted later, like at inference


def test_grayscale_folder_is_recognised_as_one_channel(tmp_path):
    for name, value in (("dark", 30), ("light", 220)):
        (tmp_path / name).mkdir()
        for index, mode in enumerate(("L", "I;16", "L")):
            image = in_mode(Image.new("RGB", (30 + index, 28), (value,) * 3), mode)
            image.save(tmp_path / name / f"{index}.png")
    stats = describe_images(load_splits(str(tmp_path), val_split=0.0).train)
    assert (stats.channels, stats.median_side, stats.num_train) == (1, 28, 6)


def solid(mode, value, size=(6, 4)):
    return Image.new(mode, size, value)


def palette_image(transparent: bool) -> Image.Image:
    image = Image.new("P", (6, 4), 1)
    image.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    if transparent:
        image.info["transparency"] = 1
    return image


MODE_CASES = [
    # image, expected RGB pixel, expected L pixel
    (solid("L", 100), (100, 100, 100), 100),
    (solid("RGB", (255, 0, 0)), (255, 0, 0), 76),  # L = 0.299 R + 0.587 G + 0.114 B
    (solid("RGBA", (0, 0, 255, 255)), (0, 0, 255), 29),
    (solid("RGBA", (0, 0, 255, 0)), (255, 255, 255), 255),  # transparent: composited over white
    (solid("LA", (40, 0)), (255, 255, 255), 255),
    (palette_image(transparent=False), (10, 200, 30), 124),
    (palette_image(transparent=True), (255, 255, 255), 255),
    (in_mode(solid("L", 128).convert("RGB"), "I;16"), (128, 128, 128), 128),  # 16 bit: 128 * 257 -> 128
    (solid("I", 65535), (255, 255, 255), 255),
    (solid("CMYK", (0, 0, 0, 0)), (255, 255, 255), 255),
    (solid("CMYK", (0, 255, 255, 0)), (255, 0, 0), 76),
    (solid("1", 1), (255, 255, 255), 255),
]


@pytest.mark.parametrize("image, rgb, gray", MODE_CASES, ids=lambda value: getattr(value, "mode", None))
def test_every_mode_converts_to_the_model_channels(image, rgb, gray):
    color = preprocess(image, identity_config(channels=3))
    assert color.shape == (3, 16, 16)
    np.testing.assert_allclose(color[:, 0, 0] * 255, rgb, atol=0.01)
    assert np.ptp(color, axis=(1, 2)).max() == 0  # a solid image stays solid after resizing
    grayscale = preprocess(image, identity_config(channels=1))
    assert grayscale.shape == (1, 16, 16)
    np.testing.assert_allclose(grayscale[0, 0, 0] * 255, gray, atol=0.01)


def test_16_bit_png_files_use_their_full_range(tmp_path):
    values = np.array([[0, 257 * 64], [257 * 192, 65535]], dtype=np.uint16).repeat(8, 0).repeat(8, 1)
    Image.fromarray(values).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    pixels = preprocess(tmp_path / "deep.png", identity_config(channels=1)) * 255
    np.testing.assert_allclose(pixels[0, [0, 0, 15, 15], [0, 15, 0, 15]], [0, 64, 192, 255], atol=0.01)


def test_normalisation_uses_the_config_mean_and_std():
    config = ViTConfig(**tiny_config(mean=[0.2, 0.4, 0.6], std=[0.5, 0.25, 0.1]))
    pixels = preprocess(solid("RGB", (255, 102, 153)), config)
    np.testing.assert_allclose(pixels[:, 3, 3], [(1 - 0.2) / 0.5, (0.4 - 0.4) / 0.25, (0.6 - 0.6) / 0.1], atol=1e-5)


def test_non_square_resize_keeps_height_and_width_apart():
    config = identity_config(channels=1, image_size=[16, 24])
    left_half_white = np.zeros((16, 24), dtype=np.uint8)
    left_half_white[:, :12] = 255
    pixels = preprocess(left_half_white, config)  # already the model size: no resizing
    assert pixels.shape == (1, 16, 24)
    assert (pixels[0, :, :12] == 1).all() and (pixels[0, :, 12:] == 0).all()


@pytest.mark.parametrize("array, expected", [
    (np.full((4, 4), 51, dtype=np.uint8), 0.2),
    (np.full((4, 4, 1), 51, dtype=np.uint8), 0.2),
    (np.full((4, 4), 257 * 51, dtype=np.uint16), 0.2),
    (np.full((4, 4), 0.2, dtype=np.float32), 0.2),
    (np.ones((4, 4), dtype=bool), 1.0),
])
def test_arrays_are_accepted_in_common_dtypes(array, expected):
    pixels = preprocess(array, identity_config(channels=1))
    np.testing.assert_allclose(pixels, expected, atol=1 / 255)


@pytest.mark.parametrize("source, error, message", [
    (np.zeros((4, 4, 2), dtype=np.uint8), ValueError, r"shape HxW, HxWx3 or HxWx4, got shape \[4, 4, 2\]"),
    (np.full((4, 4), 2.0), ValueError, r"float image array with values in \[0, 1\]"),
    (np.zeros((4, 4), dtype=np.int32), ValueError, "uint8, uint16 or float image array, got dtype int32"),
    (Image.new("RGB", (1, 5)), ValueError, "at least 2x2 pixels, got 1x5"),
    (42, TypeError, "expected an image path, PIL image or NumPy array, got int"),
], ids=["channels", "float-range", "int32", "tiny", "int"])
def test_bad_images_give_one_clear_error(source, error, message):
    with pytest.raises(error, match=message):
        preprocess(source, identity_config())


def test_unreadable_and_missing_files_are_named(corrupt_file, tmp_path):
    with pytest.raises(ValueError, match=f"{corrupt_file} is not a readable image"):
        preprocess(corrupt_file, identity_config())
    with pytest.raises(FileNotFoundError, match=f"expected an image file at {tmp_path / 'nope.png'}"):
        preprocess(tmp_path / "nope.png", identity_config())


def test_preprocess_batch_stacks_and_rejects_nothing():
    batch = preprocess_batch([solid("L", 0), np.zeros((5, 7, 3), dtype=np.uint8)], identity_config())
    assert batch.shape == (2, 3, 16, 16) and batch.dtype == np.float32
    with pytest.raises(ValueError, match="expected at least one image, got none"):
        preprocess_batch([], identity_config())


# Augmentation and loading --------------------------------------------------------------------------
def test_auto_augmentation_suits_the_data():
    assert resolve_augment("auto", ViTConfig.from_preset("mnist")) == "digits"
    assert resolve_augment("auto", ViTConfig(**tiny_config())) == "photos"
    assert resolve_augment("none", ViTConfig(**tiny_config())) == "none"
    with pytest.raises(DataError, match="--augment: expected one of auto, digits, photos, none, got 'mixup'"):
        resolve_augment("mixup", ViTConfig(**tiny_config()))


@pytest.mark.parametrize("augment, channels", [("digits", 1), ("photos", 3), ("photos", 1)])
def test_augmentation_is_random_seeded_and_keeps_the_model_shape(image_folder, augment, channels):
    config = ViTConfig(**tiny_config(in_channels=channels, image_size=[16, 24]))
    transform = TrainTransform(config, augment)
    with Image.open(image_files(image_folder)[0]) as image:
        torch.manual_seed(0)
        first, second = transform(image), transform(image)
        torch.manual_seed(0)
        replay = transform(image)
    assert first.shape == (channels, 16, 24) and first.dtype == torch.float32
    assert not torch.equal(first, second)
    assert torch.equal(first, replay)


def test_a_pen_gap_cuts_one_short_gap_in_a_stroke():
    """The upload augmentation's skipped pen: ink is only taken away, all of it within a gap's
    width of one inked pixel, and the stroke is cut through (two pieces where there was one)."""
    stroke = np.zeros((28, 28), np.uint8)
    stroke[4:24, 12:15] = 255  # a 3 px bar, MNIST's stroke width
    torch.manual_seed(0)
    gapped = [np.asarray(augmentation.with_pen_gap(Image.fromarray(stroke))) for _ in range(20)]
    for pixels in gapped:
        taken = np.argwhere(pixels < stroke)
        assert (pixels <= stroke).all() and len(taken) > 0
        assert np.ptp(taken, axis=0).max() <= 2 * augmentation.GAP_RADIUS[1] + 2
    cut = [ndimage.label(pixels >= 128)[1] == 2 for pixels in gapped]
    assert sum(cut) >= 10  # a gap at the bar's end shortens it instead
    blank = Image.new("L", (28, 28), 0)
    assert augmentation.with_pen_gap(blank) is blank


def test_loader_order_depends_only_on_the_seed():
    dataset = Labels(range(20))

    def order(seed):
        loader = make_loader(dataset, 5, shuffle=True, seed=seed, num_workers=0, pin_memory=False)
        return torch.cat([indices for indices, _ in loader]).tolist()

    assert order(1) == order(1) != order(2)
    assert sorted(order(1)) == list(range(20))


def test_transformed_yields_tensors_and_int_labels(split_image_folder):
    splits = load_splits(str(split_image_folder))
    dataset = Transformed(splits.test, EvalTransform(identity_config()))
    pixels, label = dataset[len(dataset) - 1]
    assert pixels.shape == (3, 16, 16) and label == 1 and type(label) is int


def test_config_and_preprocess_import_without_torch():
    code = ("import sys, vit_hub.model.config, vit_hub.processing.preprocess; "
            "sys.exit('torch was imported' if 'torch' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout


def augmented_epochs(dataset, sampler, workers: int, epochs=(0, 1)) -> list[torch.Tensor]:
    """Each epoch's samples as the training step sees them: `finish`ed on the batch."""
    loader = make_loader(dataset, 4, shuffle=False, seed=0, num_workers=workers, pin_memory=False,
                         sampler=sampler, persistent_workers=True, collate_fn=batches.CropBatches())
    per_epoch = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        per_epoch.append(torch.cat([dataset.transform.finish(pixels, draws) for pixels, _, draws in loader]))
    return per_epoch


def test_digits_are_canonicalised_once_and_augmented_as_if_canonicalised_each_time(tmp_path):
    """With `canonicalize: digit` the training set keeps each image's canonical form; every
    epoch's samples equal those of a dataset that canonicalises each image anew."""
    for name in ("ring", "bar"):
        (tmp_path / name).mkdir()
        for index in range(3):  # dark strokes on white paper, of three sizes and places
            page = Image.new("L", (40 + 10 * index, 36), 235)
            box = (8 + index, 6, 24 + 4 * index, 30)
            if name == "ring":
                ImageDraw.Draw(page).ellipse(box, outline=20, width=3)
            else:
                ImageDraw.Draw(page).line(box, fill=20, width=3)
            page.save(tmp_path / name / f"{index}.png")
    splits = load_splits(str(tmp_path), val_split=0.0)
    config = ViTConfig(**tiny_config(in_channels=1, image_size=[28, 28], canonicalize="digit"))
    transform = TrainTransform(config, "digits")
    kept = batches.SeededAugmentation(splits.train, transform, seed=4)
    anew = batches.SeededAugmentation(splits.train, transform, seed=4, keep_domain=False)
    assert kept.images.keep and not anew.images.keep
    keys = range(3 * len(kept))  # three epochs: the first canonicalises, the next two reuse
    for key in keys:
        (pixels, label, box), (expected, expected_label, expected_box) = kept[key], anew[key]
        assert torch.equal(pixels, expected) and label == expected_label and torch.equal(box, expected_box), key
    assert sorted(kept.images.kept) == list(range(len(kept))) and anew.images.kept == {}
    photos = ViTConfig(**tiny_config(in_channels=1, image_size=[28, 28]))
    assert batches.SeededAugmentation(splits.train, TrainTransform(photos, "none"), seed=4).images.keep


def test_photos_are_read_from_disk_once_and_kept_within_the_budget(split_image_folder, tmp_path):
    """A photo folder's training images are kept as read: a later epoch gets the same pixels
    with the files gone. Past the budget, images are read again each time."""
    shutil.copytree(split_image_folder / "train", tmp_path / "train")
    train = load_splits(str(tmp_path / "train"), val_split=0.0).train
    config = ViTConfig(**tiny_config(image_size=[16, 16]))
    kept = batches.SeededAugmentation(train, TrainTransform(config, "photos"), seed=4)
    first = [kept[key] for key in range(len(kept))]
    images = kept.images
    assert images.keep and sorted(images.kept) == list(range(len(train)))
    assert images.kept_bytes == sum(pixels.nbytes for pixels, _ in images.kept.values())
    shutil.rmtree(tmp_path / "train")  # every image now comes from what was kept
    for key, (pixels, label, box) in enumerate(first):
        again = kept[key]
        assert torch.equal(again[0], pixels) and again[1] == label and torch.equal(again[2], box), key
    budget = batches.DomainImages(load_splits(str(split_image_folder / "train"), val_split=0.0).train, config,
                                  keep=True, budget=images.kept_bytes // 2)
    for index in range(len(budget)):
        budget[index]
    assert 0 < len(budget.kept) < len(budget) and budget.kept_bytes <= images.kept_bytes // 2


@pytest.mark.parametrize("per_image", [False, True], ids=["on the batch", "per image"])
def test_augmentation_is_the_same_for_any_number_of_workers(split_image_folder, per_image):
    """Each sample's augmentation follows from (seed, epoch, index): 0 workers, 2 persistent
    workers, and the main process's RNG state change nothing, whether the photos are augmented
    on the batch (a GPU's step) or per image in the workers (a CPU-only machine)."""
    splits = load_splits(str(split_image_folder))
    config = ViTConfig(**tiny_config(image_size=[16, 16]))
    dataset = batches.SeededAugmentation(splits.train, TrainTransform(config, "photos", per_image), seed=3)

    def sampler():
        return batches.EpochSampler(len(dataset), seed=3, batch_size=4, drop_last=True)

    torch.manual_seed(0)
    in_process = augmented_epochs(dataset, sampler(), workers=0)
    torch.manual_seed(1)
    in_workers = augmented_epochs(dataset, sampler(), workers=2)
    for first, second in zip(in_process, in_workers):
        assert torch.equal(first, second)
    assert not torch.equal(in_process[0], in_process[1])  # every epoch a new shuffle and augmentation


@pytest.mark.parametrize("size, batch, drop_last", [(30, 8, True), (30, 8, False), (7, 16, False)])
def test_each_process_takes_its_share_of_the_single_process_batches(size, batch, drop_last):
    single = list(batches.EpochSampler(size, seed=5, batch_size=batch, drop_last=drop_last))
    shares = [list(batches.EpochSampler(size, seed=5, batch_size=batch, drop_last=drop_last, rank=rank, world_size=2))
              for rank in range(2)]
    per_rank = batch // 2
    for step in range(0, len(single), batch):
        together = sorted(key for share in shares for key in share[step // 2:step // 2 + per_rank])
        assert together == sorted(single[step:step + batch])
    assert len(single) == (size // batch * batch if drop_last else size)


def test_sampler_keys_name_the_epoch_and_the_index():
    sampler = batches.EpochSampler(10, seed=0, batch_size=5, drop_last=True)
    sampler.set_epoch(3)
    keys = list(sampler)
    assert sorted(key - 30 for key in keys) == list(range(10))


def test_a_large_jpeg_is_read_at_a_reduced_scale_for_training_only(tmp_path):
    """A training read of a photo much larger than the model decodes at the JPEG's own reduced
    scale, keeping DECODE_MARGIN x the model's side on the shorter side; evaluation reads it
    whole (what `preprocess` does), and so do digit models (canonicalising reads the strokes)."""
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        Image.new("RGB", (1600, 1200), (200, 120, 40)).save(tmp_path / label / "phone.jpg", quality=90)
        Image.new("RGB", (1600, 1200), (200, 120, 40)).save(tmp_path / label / "scan.png")
    train = load_splits(str(tmp_path), val_split=0.0).train
    sizes = {Path(path).name: index for index, (path, _) in enumerate(train.samples)}
    photo = ViTConfig(**tiny_config(image_size=64, patch_size=8))  # keeps 4 x 64 = 256 px: 1/4 (400x300)
    reads = batches.DomainImages(train, photo, keep=False)
    assert batches.DECODE_MARGIN * 64 == reads.min_side == 256
    assert reads[sizes["phone.jpg"]][0].size == (400, 300)
    assert reads[sizes["scan.png"]][0].size == (1600, 1200)  # only JPEG decodes at reduced scales
    assert train[sizes["phone.jpg"]][0].size == (1600, 1200)  # evaluation and inference: whole
    digit = ViTConfig(**tiny_config(image_size=28, patch_size=4, in_channels=1, canonicalize="digit"))
    assert batches.DomainImages(train, digit, keep=False).min_side is None


# A run's loaders: a new order every epoch, a disjoint evaluation shard per process -------------------
class Numbered(torch.utils.data.Dataset):
    """`size` small gray images, each labelled with its own index: the labels a loader gives say
    which images it read, and in which order."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return Image.new("L", (16, 16), index), index


def numbered_run_loaders(monkeypatch, seed: int = 3, rank: int = 0, world_size: int = 1) -> RunLoaders:
    """The loaders `build_loaders` gives process `rank` of `world_size` for 24 training and 7
    validation images (global batch 8, no workers)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # build_loaders then leaves torch's threads as they are
    splits = DataSplits(train=Numbered(24), val=Numbered(7), test=None, labels=LABELS, source="numbered")
    settings = TrainSettings(data="numbered", out="unused", augment="none", num_workers=0, seed=seed)
    schedule = Schedule(epochs=3, batch_size=8, peak_lr=1e-3, warmup_epochs=0.0, steps_per_epoch=3)
    runtime = Runtime(torch.device("cpu"), rank=rank, world_size=world_size)
    return build_loaders(settings, runtime, identity_config(channels=1), splits, schedule)


@pytest.mark.parametrize("device, per_image", [("cpu", True), ("meta", False)])
def test_photos_are_augmented_per_image_in_the_workers_only_on_a_cpu(monkeypatch, split_image_folder, device,
                                                                      per_image):
    """A CPU-only run has no device to hand the batch to: its workers augment each photo with
    PIL and send it at the model's size. Any other device augments the batch in the step."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    splits = load_splits(str(split_image_folder), val_split=0.0)
    settings = TrainSettings(data="photos", out="unused", augment="photos", num_workers=0, seed=0)
    schedule = Schedule(epochs=1, batch_size=4, peak_lr=1e-3, warmup_epochs=0.0, steps_per_epoch=1)
    loaders = build_loaders(settings, Runtime(torch.device(device)), identity_config(image_size=[12, 12]), splits,
                            schedule)
    assert loaders.train_loader.dataset.transform.per_image is per_image
    pixels, _, draws = next(iter(loaders.epoch(0)))
    assert (pixels.shape[2:] == (12, 12)) is per_image  # the folder's photos are 16x16: the crops are 11-16 px
    assert loaders.model_input(pixels, draws).shape == (len(pixels), 3, 12, 12)


def training_order(loaders: RunLoaders, epoch: int) -> list[int]:
    return [index for _, labels, _ in loaders.epoch(epoch) for index in labels.tolist()]


def test_every_epoch_trains_on_a_new_order_and_the_seed_alone_decides_it(monkeypatch):
    loaders = numbered_run_loaders(monkeypatch, seed=3)
    orders = [training_order(loaders, epoch) for epoch in range(3)]
    assert all(sorted(order) == list(range(24)) for order in orders)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    again = numbered_run_loaders(monkeypatch, seed=3)
    assert [training_order(again, epoch) for epoch in (2, 0, 1)] == [orders[2], orders[0], orders[1]]
    assert training_order(numbered_run_loaders(monkeypatch, seed=4), 0) != orders[0]


def test_each_process_evaluates_its_own_shard_and_together_they_cover_every_image_once(monkeypatch):
    """Under DDP each process scores its shard and the counts are summed: shards that overlap
    would count some images twice and others never."""
    shards = [[index for _, labels in numbered_run_loaders(monkeypatch, rank=rank, world_size=2).eval_loader("val")
               for index in labels.tolist()] for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(7))
    assert len(shards[0]) == 4 and len(shards[1]) == 3


# Training's two halves: uint8 from the workers, finished on the device ----------------------------------
def test_unaugmented_training_input_equals_preprocess_with_per_image_statistics(split_image_folder):
    """Per-image normalisation on the device matches NumPy's to float32 rounding (the config's
    mean and std match bit for bit: test_training_and_evaluation_datasets_see_...)."""
    config = ViTConfig(**tiny_config(image_size=[16, 24], pixel_norm="image"))
    splits = load_splits(str(split_image_folder), val_split=0.0)
    transform = TrainTransform(config, augment="none")
    for index, (path, _) in enumerate(splits.train.samples):
        pixels, draws = transform.prepare(splits.train[index][0])
        assert pixels.dtype == torch.uint8 and pixels.shape == (16, 24, 3) and draws[ERASE].tolist() == [0, 0, 0, 0]
        expected = torch.from_numpy(preprocess(path, config))
        # each side sums in float32 in its own order; a small std (a flat channel) magnifies that
        finished = transform.finish(pixels.permute(2, 0, 1)[None], draws[None])[0]
        torch.testing.assert_close(finished, expected, rtol=1e-5, atol=1e-4)


def test_model_input_erases_only_the_boxes_after_normalising():
    config = ViTConfig(**tiny_config(image_size=[8, 12], mean=0.2, std=0.5))
    pixels = torch.full((2, 3, 8, 12), 255, dtype=torch.uint8)
    draws = torch.stack([unaugmented_draws(8, 12), unaugmented_draws(8, 12)])
    draws[0, ERASE] = torch.tensor([1.0, 2, 3, 4])
    images = augmentation.ModelInput(config)(pixels, draws)
    erased = torch.zeros(8, 12, dtype=torch.bool)
    erased[1:4, 2:6] = True
    assert (images[0][:, erased] == 0).all()
    assert torch.allclose(images[0][:, ~erased], torch.tensor(1.6)) and torch.allclose(images[1], torch.tensor(1.6))


def test_per_core_worker_choice_follows_the_device(monkeypatch):
    monkeypatch.setattr(batches.os, "cpu_count", lambda: 16)
    assert batches.default_workers() == 8  # CPU: half the cores run the model
    assert batches.default_workers("cpu", processes=2) == 4
    assert batches.default_workers("cuda") == 15  # GPU: all but the training loop's core
    assert batches.default_workers("cuda", processes=8) == 1
    monkeypatch.setattr(batches.os, "cpu_count", lambda: 64)
    assert batches.default_workers("cuda") == 16


def test_an_image_turned_upright_is_not_turned_again_when_read_a_second_time(tmp_path):
    """load_image turns a photo by its EXIF orientation and drops that orientation: the Python
    API's predict, given an image load_image already read (as the app and the export's checks
    hand it on), must not turn it a second time."""
    from vit_hub.processing.preprocess import load_image, open_image

    stored = Image.fromarray(np.arange(80 * 120 * 3, dtype=np.uint8).reshape(80, 120, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: shown turned 90 degrees clockwise
    stored.save(tmp_path / "turned.png", exif=exif.tobytes())
    once = load_image(open_image(tmp_path / "turned.png"))
    assert once.size == (80, 120)
    np.testing.assert_array_equal(np.asarray(load_image(load_image(once))), np.asarray(once))
