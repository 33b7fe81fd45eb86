"""Input pipeline throughput on the CPU: a per-image PIL loader (vit_hub/data.py at a revision
given), vit_hub's loader, timm's, and the model's own step rate; and start-up time on a
100k-file folder, the PIL loader's and vit_hub's.

    flock -x /tmp/cpu.lock python bench/input_pipeline.py --reference REV [--images 1200] [--batch-size 32]
        [--rounds 5] [--batches 4] [--workers 2] [--startup-files 100000] [--work /tmp/vit_hub_input_bench]

Loaders, on one generated folder of 256x256 JPEGs (10 classes) at 224x224 with the default photo
augmentation (random-resized crop of 50-100 % of the area, horizontal flip, colour jitter
0.3/0.3/0.3/0.1, RandAugment 2 ops at magnitude 9, random erasing with p 0.25), batches as the
training step receives them (normalised float32 [B, 3, 224, 224] on the device, here the CPU):

  * PIL per image: vit_hub/data.py at `--reference REV`, a revision of this repository that
    holds that single module (BENCHMARKS.md names the one measured; read with `git show` into
    a temporary module): every worker decodes, augments with torchvision's transforms on PIL
    images, normalises in NumPy and sends float32 tensors.
  * vit_hub: vit_hub.data.augmentation and vit_hub.data.batches: uint8 tensors from the workers, colour jitter as one affine colour map,
    normalisation and erasing in the step (`ModelInput`).
  * timm: `timm.data.create_loader` with the same crop, flip, RandAugment ('rand-m9-n2'),
    erasing (re_prob 0.25, const) and colour jitter, which timm drops when RandAugment is on
    unless forced: the dataset's transform is timm's `transforms_imagenet_train(...,
    force_color_jitter=True)`; its prefetcher normalises and erases in the main process.
    Also timm as `create_loader` builds it (no colour jitter), for reference.

Workers are not kept between rounds (a kept worker would go on preparing batches while the next
loader is timed); the first batch of every round is untimed. "Per core" is one process with one thread and no workers (`--workers 0`): decode, augmentation
and the step-side work all on that core. The second figure runs `--workers` worker processes
and divides the wall-clock rate by the cores they share (`os.cpu_count()`). Rounds alternate
the loaders (the order turns every round) so machine noise hits all; medians are reported,
with per-round ratios. The step row is the vit_hub model of the same input (ViT-S/16) training
on random tensors, one thread: what one core must feed.

Start-up: `load_splits` on a folder of `--startup-files` tiny JPEGs (one 16x16 image copied,
10 classes), by the PIL loader (decodes every file) and vit_hub's (lists them), warm page cache,
alternating.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from vit_hub.data import augmentation, batches  # noqa: E402
from vit_hub.data import sources as vdata  # noqa: E402
from vit_hub.model.config import ViTConfig  # noqa: E402

PIL_LOADER = "PIL per image"  # the reference revision's loader, in the tables
VIT_HUB_LOADER = "vit_hub"
SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def reference_data_module(revision: str):
    """vit_hub/data.py at `revision`, run as the module vit_hub._data_reference (its relative
    imports pointed at this tree's modules: config, colour and preprocess)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:vit_hub/data.py"], capture_output=True,
                            text=True, check=True).stdout
    for old, new in (("from .colour ", "from vit_hub.data.colour "), ("from .config ", "from vit_hub.model.config "),
                     ("from .preprocess ", "from vit_hub.processing.preprocess ")):
        source = source.replace(old, new)
    # this tree's normalize takes channels-first pixels ([..., C, H, W]); that loader gives it HxWxC
    source = source.replace("preprocess import normalize,", "preprocess import channels_first, normalize,")
    source = source.replace("normalize(np.asarray(image), self.config)",
                            "normalize(channels_first(np.asarray(image)), self.config)")
    module = types.ModuleType("vit_hub._data_reference")
    module.__package__ = "vit_hub"
    module.__file__ = str(REPO / "vit_hub" / "data.py")  # BUNDLED_MNIST: the package folder's bundled/
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:vit_hub/data.py", "exec"), module.__dict__)
    return module


def make_photos(root: Path, count: int, side: int = 256, seed: int = 0) -> Path:
    """`count` JPEGs of smooth colour fields with discs and sensor noise, 10 classes."""
    if (root / "done").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(seed)
    for index in range(count):
        folder = root / f"class{index % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        low = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(low).resize((side, side), Image.Resampling.BICUBIC)
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x, y = rng.integers(0, side, 2)
            r = int(rng.integers(10, 60))
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        noisy = np.asarray(image).astype(np.int16) + rng.normal(0, 6, (side, side, 3)).astype(np.int16)
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / f"{index:06d}.jpg", quality=90)
    (root / "done").write_text("")
    return root


def make_tiny_files(root: Path, count: int) -> Path:
    if (root / "done").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    buffer = root / "tiny.jpg"
    root.mkdir(parents=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buffer)
    payload = buffer.read_bytes()
    buffer.unlink()
    for index in range(count):
        folder = root / f"class{index % 10}"
        folder.mkdir(exist_ok=True)
        (folder / f"{index:06d}.jpg").write_bytes(payload)
    (root / "done").write_text("")
    return root


def config() -> ViTConfig:
    return ViTConfig(image_size=SIZE, patch_size=16, embed_dim=384, depth=12, num_heads=6,
                     labels=[f"class{i}" for i in range(10)], mean=list(MEAN), std=list(STD))


# Loaders: each returns an iterator factory of float batches as the step receives them ---------------------
class PilLoader:
    name = PIL_LOADER

    def __init__(self, old, folder: Path, batch: int, workers: int):
        splits = old.load_splits(str(folder), val_split=0.0)
        dataset = old.SeededAugmentation(splits.train, old.TrainTransform(config(), "photos"), seed=0)
        self.sampler = old.EpochSampler(len(dataset), 0, batch, drop_last=True)
        self.loader = old.make_loader(dataset, batch, shuffle=False, seed=0, num_workers=workers, pin_memory=False,
                                      sampler=self.sampler)

    def batches(self, epoch: int):
        self.sampler.set_epoch(epoch)
        for images, _ in self.loader:
            yield images


class VitHubLoader:
    name = VIT_HUB_LOADER

    def __init__(self, folder: Path, batch: int, workers: int):
        splits = vdata.load_splits(str(folder), val_split=0.0)
        transform = augmentation.TrainTransform(config(), "photos")
        dataset = batches.SeededAugmentation(splits.train, transform, seed=0)
        self.model_input = transform.model_input
        self.sampler = batches.EpochSampler(len(dataset), 0, batch, drop_last=True)
        self.loader = batches.make_loader(dataset, batch, shuffle=False, seed=0, num_workers=workers, pin_memory=False,
                                        sampler=self.sampler)

    def batches(self, epoch: int):
        self.sampler.set_epoch(epoch)
        for pixels, _, boxes in self.loader:
            yield self.model_input(pixels, boxes)


class Timm:
    def __init__(self, folder: Path, batch: int, workers: int, jitter: bool):
        from timm.data import ImageDataset, create_loader
        from timm.data.transforms_factory import transforms_imagenet_train

        self.name = "timm, colour jitter forced (same augmentation)" if jitter else "timm as create_loader builds it"
        dataset = ImageDataset(str(folder))
        options = dict(scale=(0.5, 1.0), hflip=0.5, color_jitter=(0.3, 0.3, 0.3, 0.1), auto_augment="rand-m9-n2",
                       interpolation="bilinear", re_prob=0.25)
        self.loader = create_loader(
            dataset, input_size=(3, SIZE, SIZE), batch_size=batch, is_training=True, re_mode="const", mean=MEAN,
            std=STD, num_workers=workers, device=torch.device("cpu"), use_prefetcher=True,
            persistent_workers=False, **options)
        if jitter:  # what create_loader made, plus the colour jitter it leaves out next to RandAugment
            dataset.transform = transforms_imagenet_train(SIZE, force_color_jitter=True, use_prefetcher=True,
                                                          mean=MEAN, std=STD, **options)

    def batches(self, epoch: int):
        for images, _ in self.loader:
            yield images


def time_loaders(loaders, rounds: int, batches: int, batch: int) -> dict[str, list[float]]:
    """img/s of each loader per round, `batches` batches after one untimed batch."""
    rates: dict[str, list[float]] = {loader.name: [] for loader in loaders}
    for round_index in range(rounds):
        order = loaders[round_index % len(loaders):] + loaders[:round_index % len(loaders)]
        for loader in order:
            iterator = loader.batches(round_index)
            next(iterator)  # workers started, first batch out of the way
            started = time.perf_counter()
            for _ in range(batches):
                images = next(iterator)
                assert images.dtype == torch.float32 and images.shape[1:] == (3, SIZE, SIZE)
            rates[loader.name].append(batches * batch / (time.perf_counter() - started))
            del iterator
    return rates


def step_rate(batch: int, steps: int) -> tuple[float, float]:
    """The vit_hub model's training steps on random tensors, one thread: (img/s, GFLOP/s)."""
    from vit_hub.hub.pretrained import HubVisionTransformer
    from vit_hub.model.flops import training_flops
    from vit_hub.train.step import parameter_groups

    torch.manual_seed(0)
    model = HubVisionTransformer(**config().to_dict()).train()
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.05), lr=1e-3, fused=True)
    images, labels = torch.randn(batch, 3, SIZE, SIZE), torch.randint(0, 10, (batch,))

    def step():
        loss = torch.nn.functional.cross_entropy(model(images).logits, labels, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    rate = steps * batch / (time.perf_counter() - started)
    return rate, rate * training_flops(model) / 1e9


def startup(old, folder: Path, rounds: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {PIL_LOADER: [], VIT_HUB_LOADER: []}
    for round_index in range(rounds):
        for name in ((PIL_LOADER, VIT_HUB_LOADER) if round_index % 2 == 0 else (VIT_HUB_LOADER, PIL_LOADER)):
            load = old.load_splits if name == PIL_LOADER else vdata.load_splits
            started = time.perf_counter()
            splits = load(str(folder), val_split=0.1, seed=0)
            seconds[name].append(time.perf_counter() - started)
            assert len(splits.train) + len(splits.val) == len(list((folder / "class0").iterdir())) * 10
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, metavar="REV",
                        help="a revision whose vit_hub/data.py holds the per-image PIL loader")
    parser.add_argument("--images", type=int, default=1200, help="JPEGs in the generated folder")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of every loader")
    parser.add_argument("--batches", type=int, default=4, help="timed batches per loader and round")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for the second figure")
    parser.add_argument("--step-batch", type=int, default=8, help="batch of the model step row")
    parser.add_argument("--startup-files", type=int, default=100_000)
    parser.add_argument("--startup-rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/vit_hub_input_bench", help="where the folders are generated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import timm

    work = Path(args.work)
    photos = make_photos(work / f"photos_{args.images}", args.images)
    old = reference_data_module(args.reference)

    results = {}
    for workers in (0, args.workers):
        loaders = [PilLoader(old, photos, args.batch_size, workers), VitHubLoader(photos, args.batch_size, workers),
                   Timm(photos, args.batch_size, workers, jitter=True),
                   Timm(photos, args.batch_size, workers, jitter=False)]
        results[workers] = time_loaders(loaders, args.rounds, args.batches, args.batch_size)
        del loaders
    step_images, step_gflops = step_rate(args.step_batch, steps=3)
    tiny = make_tiny_files(work / f"tiny_{args.startup_files}", args.startup_files)
    starts = startup(old, tiny, args.startup_rounds)

    cores = os.cpu_count() or 1
    print(f"command: python bench/input_pipeline.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, timm {timm.__version__}, {cores} cores, load average "
          f"{'/'.join(f'{value:.2f}' for value in os.getloadavg()[:2])} (1/5 min, at the end)\n")
    print(f"{args.images} JPEGs of 256x256 at {SIZE}x{SIZE}, batch {args.batch_size}, {args.rounds} rounds of "
          f"{args.batches} batches, medians (min-max)\n")
    print(f"| loader | img/s per core (1 process, 1 thread) | img/s with {args.workers} workers / {cores} cores "
          f"| per core vs {PIL_LOADER} | per core vs timm (same augmentation) |")
    print("|---|---|---|---|---|")
    single, multi = results[0], results[args.workers]
    timm_name = "timm, colour jitter forced (same augmentation)"
    for name in single:
        def paired(reference: str) -> str:
            ratios = [a / b for a, b in zip(single[name], single[reference])]
            return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

        print(f"| {name} | {statistics.median(single[name]):.1f} ({min(single[name]):.1f}-{max(single[name]):.1f}) | "
              f"{statistics.median(multi[name]) / cores:.1f} | {paired(PIL_LOADER)} | {paired(timm_name)} |")
    print(f"| model step alone (ViT-S/16, batch {args.step_batch}, fp32) | {step_images:.1f} "
          f"({step_gflops:.1f} GFLOP/s achieved; no MFU: a CPU has no single peak) | | | |\n")
    pil, ours = statistics.median(starts[PIL_LOADER]), statistics.median(starts[VIT_HUB_LOADER])
    print(f"start-up, load_splits on {args.startup_files:,} tiny JPEGs (median of {args.startup_rounds}): "
          f"{PIL_LOADER} {pil:.2f} s ({', '.join(f'{s:.2f}' for s in starts[PIL_LOADER])}), "
          f"{VIT_HUB_LOADER} {ours:.3f} s ({', '.join(f'{s:.3f}' for s in starts[VIT_HUB_LOADER])}): "
          f"{pil / ours:.0f}x faster")


if __name__ == "__main__":
    main()
