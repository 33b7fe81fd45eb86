"""The photo augmentation done on whole batches (vit_hub.data.batch_augmentation) is the
per-image augmentation it replaced: the same draws, from the same ranges, with each image its
own, and per operation the same pixels as torchvision's or PIL's form of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from vit_hub.data import batch_augmentation as batched
from vit_hub.data.augmentation import TrainTransform, random_crop, uint8_pixels
from vit_hub.data.batch_augmentation import (CROP, ERASE, FLIP, JITTER_AMOUNTS, JITTER_ORDER, MAGNITUDES, NO_BOX, OPS,
                                             RAND_AUGMENT_NAMES)
from vit_hub.data.batches import CropBatches
from vit_hub.model.config import ViTConfig

SIZE = (20, 24)  # the model's image size in these tests (height, width)


def photos(count: int, seed: int = 0, size: tuple[int, int] = SIZE) -> torch.Tensor:
    """uint8 [count, 3, H, W]: smooth colour fields with noise, far from flat."""
    generator = torch.Generator().manual_seed(seed)
    low = torch.rand(count, 3, 4, 4, generator=generator) * 255
    smooth = torch.nn.functional.interpolate(low, size=size, mode="bilinear", align_corners=False)
    return (smooth + torch.randn(count, 3, *size, generator=generator) * 12).round().clamp(0, 255).to(torch.uint8)


def seeded_draws(count: int, seed: int = 0) -> torch.Tensor:
    """[count, DRAW_SIZE]: image i's draws from seed (seed, i), crops of the model's size."""
    return torch.stack([batched.draw_photo_augmentation(np.random.default_rng([seed, index]), SIZE, SIZE)
                        for index in range(count)])


@pytest.fixture(scope="module")
def mixed_batch():
    """200 photos and their draws: every RandAugment operation is drawn in both slots."""
    draws = seeded_draws(200)
    for slot in range(batched.RAND_AUGMENT_OPS):
        assert set(draws[:, OPS.start + slot].long().tolist()) == set(range(len(RAND_AUGMENT_NAMES)))
    return photos(200), draws


@pytest.mark.parametrize("name", RAND_AUGMENT_NAMES)
def test_each_rand_augment_operation_equals_torchvisions_on_each_image(mixed_batch, name):
    """Every image that drew the operation, in a batch where each image drew its own, equals
    v2.RandAugment's own application of that operation and magnitude to the image alone; the
    magnitude is v2.RandAugment's (bin 9 of 31) and a signed operation is drawn with both signs."""
    images, draws = mixed_batch
    op = RAND_AUGMENT_NAMES.index(name)
    result = batched.rand_augment_op(images, draws[:, OPS.start].long(), draws[:, MAGNITUDES.start])
    chosen = (draws[:, OPS.start] == op).nonzero()[:, 0].tolist()
    assert chosen
    reference = v2.RandAugment(num_ops=2, magnitude=9)
    fill = reference._fill  # black, as v2.RandAugment fills by default
    for index in chosen:
        magnitude = float(draws[index, MAGNITUDES.start])
        expected = reference._apply_image_or_video_transform(images[index], name, magnitude,
                                                             interpolation=reference.interpolation, fill=fill)
        assert torch.equal(expected, result[index]), (name, index)
    magnitudes = draws[chosen, MAGNITUDES.start]
    bins, signed = batched.RAND_AUGMENT_SPACE[name]
    expected_size = 0.0 if bins(31, *SIZE) is None else float(bins(31, *SIZE)[9])
    assert magnitudes.abs().tolist() == pytest.approx([expected_size] * len(chosen))
    assert (magnitudes.min() < 0 < magnitudes.max()) if signed else magnitudes.min() >= 0


def test_draws_come_from_torchvisions_ranges_with_each_image_its_own():
    draws = seeded_draws(2000, seed=1)
    assert 0.45 < draws[:, FLIP].mean() < 0.55
    assert (draws[:, JITTER_ORDER].sort(1).values == torch.arange(4.0)).all()  # a permutation each
    factors, turns = draws[:, JITTER_AMOUNTS][:, :3], draws[:, JITTER_AMOUNTS][:, 3]
    assert factors.min() >= 0.7 and factors.max() <= 1.3 and factors.std(0).min() > 0.15
    assert turns.abs().max() <= 0.1 and turns.std() > 0.05
    counts = torch.bincount(draws[:, OPS].long().flatten(), minlength=len(RAND_AUGMENT_NAMES))
    assert counts.min() > 4000 / 14 * 0.7  # each operation about as often as any other
    erased = draws[:, ERASE][:, 2] > 0
    assert 0.2 < erased.float().mean() < 0.3  # random erasing's p = 0.25
    assert len({tuple(row.tolist()) for row in draws}) == len(draws)  # no two images drew alike


@pytest.mark.parametrize("height, width", [(60, 90), (64, 64), (100, 40)])
def test_crop_boxes_come_from_random_resized_crops_distribution(height, width):
    """Crop boxes drawn here and by torchvision's RandomResizedCrop(scale 0.5-1, ratio 3:4-4:3)
    on the same frame: areas, aspect ratios and places alike in distribution (4,000 each)."""
    rng = np.random.default_rng(0)
    ours = np.array([batched.crop_box(rng, height, width) for _ in range(4000)], dtype=float)  # top, left, h, w
    torch.manual_seed(0)
    frame = torch.zeros(1, height, width)
    theirs = np.array([T.RandomResizedCrop.get_params(frame, [0.5, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)],
                      dtype=float)
    for boxes in (ours, theirs):
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= height).all()
        assert (boxes[:, 1] + boxes[:, 3] <= width).all()

    def features(boxes):  # area share, aspect, centre row and column as shares of the frame
        return np.stack([boxes[:, 2] * boxes[:, 3] / (height * width), boxes[:, 3] / boxes[:, 2],
                         (boxes[:, 0] + boxes[:, 2] / 2) / height, (boxes[:, 1] + boxes[:, 3] / 2) / width], 1)

    quantiles = [0.1, 0.25, 0.5, 0.75, 0.9]
    np.testing.assert_allclose(np.quantile(features(ours), quantiles, axis=0),
                               np.quantile(features(theirs), quantiles, axis=0), atol=0.03)


def test_erasing_boxes_come_from_random_erasings_distribution():
    """Boxes drawn here and by torchvision's RandomErasing(p 0.25, scale 0.02-0.33, ratio
    0.3-3.3) on a 20x30 image: about a quarter of the images, sizes and places alike."""
    rng = np.random.default_rng(0)
    ours = [batched.erasing_box(rng, 20, 30) for _ in range(6000)]
    drawn = np.array([box for box in ours if box != NO_BOX], dtype=float)
    assert 0.23 < len(drawn) / len(ours) < 0.27
    torch.manual_seed(0)
    image = torch.zeros(1, 20, 30)
    theirs = np.array([T.RandomErasing.get_params(image, (0.02, 0.33), (0.3, 3.3), [0])[:4] for _ in range(1500)],
                      dtype=float)
    theirs = theirs[theirs[:, 2] < 20]  # get_params returns the whole image when no box fitted
    for boxes in (drawn, theirs):
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= 20).all()
        assert (boxes[:, 1] + boxes[:, 3] <= 30).all()
    quantiles = [0.1, 0.25, 0.5, 0.75, 0.9]
    np.testing.assert_allclose(np.quantile(drawn, quantiles, axis=0), np.quantile(theirs, quantiles, axis=0), atol=1.01)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "box", "hamming", "lanczos", "nearest"])
def test_resampling_crops_of_many_sizes_in_one_batch_equals_pils_resize(interpolation):
    """Crops from half to twice the model's size, padded into one batch, resized and some
    mirrored: each equals PIL's resize of that crop (and PIL's mirror), to a gray level."""
    generator = np.random.default_rng(0)
    crops = [Image.fromarray(photos(1, seed, (int(h), int(w)))[0].permute(1, 2, 0).numpy())
             for seed, (h, w) in enumerate(generator.integers([10, 12], [41, 49], size=(12, 2)))]
    flipped = torch.tensor([index % 3 == 0 for index in range(len(crops))])
    samples = [(uint8_pixels(crop), 0, batched.unaugmented_draws(crop.height, crop.width)) for crop in crops]
    pixels, _, draws = CropBatches()(samples)
    result = batched.resample(pixels, draws[:, CROP].long(), flipped, SIZE, interpolation)
    for index, crop in enumerate(crops):
        expected = crop.resize(SIZE[::-1], Image.Resampling[interpolation.upper()])
        if flipped[index]:
            expected = expected.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        difference = (result[index].permute(1, 2, 0).int() - torch.from_numpy(np.array(expected)).int()).abs()
        assert difference.max() <= 1, (interpolation, crop.size, int(difference.max()))


def test_colour_jitter_keeps_grey_scales_and_turns_hue_per_image():
    grey = torch.full((1, 3, 4, 4), 90, dtype=torch.uint8)
    order = torch.arange(4)[None]
    assert (batched.colour_jitter(grey, order, torch.tensor([[1.0, 1.0, 1.3, 0.1]])) == 90).all()  # saturation, hue
    red = torch.tensor([150, 100, 100], dtype=torch.uint8)[None, :, None, None].expand(3, 3, 4, 4)
    amounts = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.1], [1.2, 1.0, 1.0, 0.0]])
    result = batched.colour_jitter(red, order.expand(3, 4), amounts)[:, :, 0, 0].int()
    assert result[0].tolist() == [150, 100, 100]  # all factors 1: the image as it was
    assert result[1].sum() == pytest.approx(350, abs=2) and result[1].tolist() != [150, 100, 100]  # turned about grey
    assert result[2].tolist() == [180, 120, 120]  # brightness 1.2, this image only
    third = batched._hue_turns(torch.tensor([2 * np.pi / 3]))[0]
    torch.testing.assert_close(third @ torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1, 0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("operation, reference", [
    (batched.BRIGHTNESS, F.adjust_brightness), (batched.CONTRAST, F.adjust_contrast),
    (batched.SATURATION, F.adjust_saturation)])
def test_each_colour_map_alone_equals_torchvisions(operation, reference):
    """With the other factors at 1, each image's brightness, contrast or saturation factor
    gives torchvision's adjustment of that image by that factor, to a gray level or two (the
    grey that saturation blends towards is whole levels in torchvision, exact here)."""
    images = photos(8, seed=3)
    factors = torch.linspace(0.7, 1.3, 8)
    amounts = torch.tensor([1.0, 1.0, 1.0, 0.0]).repeat(8, 1)
    amounts[:, operation] = factors
    result = batched.colour_jitter(images, torch.arange(4).repeat(8, 1), amounts)
    for index in range(8):
        expected = reference(images[index], float(factors[index]))
        assert (result[index].int() - expected.int()).abs().max() <= 2, index


def test_the_worker_cuts_a_large_crop_down_to_at_most_twice_the_model_size():
    config = ViTConfig(image_size=list(SIZE), patch_size=4, embed_dim=8, depth=1, num_heads=1, labels=["a", "b"])
    large = Image.fromarray(photos(1, 5, (400, 500))[0].permute(1, 2, 0).numpy())
    rng = np.random.default_rng(0)
    for _ in range(20):
        crop = random_crop(large, config, rng)
        assert SIZE[0] <= crop.height < 2 * SIZE[0] or SIZE[1] <= crop.width < 2 * SIZE[1]
        assert crop.height >= SIZE[0] and crop.width >= SIZE[1]


def test_a_photos_result_in_a_padded_batch_equals_its_batch_of_one():
    config = ViTConfig(image_size=list(SIZE), patch_size=4, embed_dim=8, depth=1, num_heads=1, labels=["a", "b"])
    transform = TrainTransform(config, "photos")
    images = [Image.fromarray(photos(1, seed, (30 + seed, 40 - seed))[0].permute(1, 2, 0).numpy()) for seed in range(6)]
    samples = [transform.prepare(image, seed) for seed, image in enumerate(images)]
    pixels, _, draws = CropBatches()([(crop, 0, row) for crop, row in samples])
    in_batch = transform.finish(pixels, draws)
    crop, row = transform.prepare(images[2], 2)  # alone: a batch of one, nothing padded
    pixels, _, draws = CropBatches()([(crop, 0, row)])
    assert torch.equal(transform.finish(pixels, draws)[0], in_batch[2])


def per_image_and_batched(draws: list[torch.Tensor], crops: list[np.ndarray], per_image_draws=None):
    """The same crops through the same draws per image with PIL and on one batch: the mean
    |difference| of each image, in gray levels."""
    pixels, _, batch_draws = CropBatches()([(torch.from_numpy(crop), 0, row) for crop, row in zip(crops, draws)])
    batch = batched.augment_photos(pixels, batch_draws, SIZE, "bilinear")
    alone = torch.stack([uint8_pixels(batched.augment_photo(Image.fromarray(crop), row, SIZE, "bilinear"))
                         for crop, row in zip(crops, per_image_draws or draws)]).permute(0, 3, 1, 2)
    return (alone.float() - batch.float()).abs().flatten(1).mean(1)


def test_per_image_augmentation_with_pil_is_the_batchs_up_to_rounding():
    """A CPU-only machine augments each photo in its worker with PIL (`augment_photo`): the
    same draws give the batch's images up to rounding (PIL resamples and maps colours in fixed
    point). A mirror or a colour order taken wrongly is far off."""
    crops = [photos(1, seed, (30 + seed % 7 * 5, 40 - seed % 5 * 3))[0].permute(1, 2, 0).numpy() for seed in range(100)]
    draws = [batched.draw_photo_augmentation(np.random.default_rng([1, index]), crop.shape[:2], SIZE)
             for index, crop in enumerate(crops)]
    differences = per_image_and_batched(draws, crops)
    assert differences.median() <= 0.25 and differences.max() <= 1.0, differences.sort().values[-5:]
    mirrored = [torch.cat([row[:FLIP], 1 - row[FLIP:FLIP + 1], row[FLIP + 1:]]) for row in draws]
    assert per_image_and_batched(draws, crops, mirrored).median() > 20
    reordered = [torch.cat([row[:JITTER_ORDER.start], row[JITTER_ORDER].flip(0), row[JITTER_ORDER.stop:]])
                 for row in draws]
    assert per_image_and_batched(draws, crops, reordered).max() > 2
