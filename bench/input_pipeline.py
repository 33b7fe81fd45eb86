"""The training input pipeline on the CPU: the CPU time a loader worker spends per image in this
tree against vit_hub at a reference revision, the batched augmentation's own cost on the CPU,
whole loaders per core (both vit_hub revisions and timm's), and the model's own step rate.

    flock -x /tmp/cpu.lock python bench/input_pipeline.py --reference REV [--images 1200] [--batch-size 32]
        [--rounds 5] [--samples 96] [--batches 4] [--workers 2] [--work /tmp/vit_hub_input_bench]

All on one generated folder of 256x256 JPEGs (10 classes) at 224x224 with the default photo
augmentation (random-resized crop of 50-100 % of the area, horizontal flip, colour jitter
0.3/0.3/0.3/0.1, RandAugment 2 ops at magnitude 9, random erasing with p 0.25).

  * Worker CPU per image: what one DataLoader worker does for one training image, timed with
    the process's CPU clock in one process with one thread: `SeededAugmentation[key]` on images
    not read before (decoded from the file, as in a first epoch or a folder larger than the
    kept-image budget). At `--reference REV` that is the whole augmentation. In this tree, as
    a GPU machine's worker: the decode, the crop's box and the draws; the rest runs on the
    batch, and its cost on the CPU device (collate, `finish`, per image of `--batch-size`
    batches) is the next column, the work a GPU takes over. Then this tree's worker on a
    CPU-only machine (`per_image`: the draws applied to the image with PIL in the worker).
  * Loaders per core: the training loader as the trainer builds it on a CPU-only machine,
    batches as the step receives them (normalised float32 [B, 3, 224, 224]); one process, one
    thread, no workers; then with `--workers` workers, img/s divided by the cores. timm's
    `create_loader` with the same augmentation (colour jitter forced: timm drops it beside
    RandAugment) and as it builds itself.

Each vit_hub revision runs in its own process (PYTHONPATH at its tree; the reference tree is a
temporary `git worktree`). Rounds alternate the measurements (the order turns every round) so
machine noise hits all; medians are reported with per-round ratios. The step row is the vit_hub
model of the same input (ViT-S/16) training on random tensors, one thread: what one core must feed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TIMM_SAME, TIMM_OWN = "timm, colour jitter forced (same augmentation)", "timm as create_loader builds it"


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


def config():
    from vit_hub.model.config import ViTConfig

    return ViTConfig(image_size=SIZE, patch_size=16, embed_dim=384, depth=12, num_heads=6,
                     labels=[f"class{i}" for i in range(10)], mean=list(MEAN), std=list(STD))


# Measurements, each run in a child process at one tree ---------------------------------------------
def training_set(folder: Path, keep: bool, per_image: bool = False):
    """The training set as the trainer builds it; `per_image` as on a CPU-only machine (this
    tree only: the reference augments each image in the worker whatever the device)."""
    from vit_hub.data import batches
    from vit_hub.data.augmentation import TrainTransform
    from vit_hub.data.sources import load_splits

    transform = TrainTransform(config(), "photos", per_image) if per_image else TrainTransform(config(), "photos")
    train = load_splits(str(folder), val_split=0.0).train
    return batches.SeededAugmentation(train, transform, seed=0, keep_domain=keep), transform


def has_batch_augmentation() -> bool:
    from vit_hub.data import batches

    return hasattr(batches, "CropBatches")


def worker_ms(dataset, keys: list[int]) -> tuple[float, list]:
    """(CPU ms per image of `dataset[key]` over `keys`, what it made), after one untimed image."""
    dataset[keys[0]]  # imports and caches out of the way
    started = time.process_time()
    made = [dataset[key] for key in keys]
    return (time.process_time() - started) / len(keys) * 1e3, made


def worker_cpu(folder: Path, round_index: int, samples: int, batch: int, batches_timed: int) -> dict:
    """CPU ms per image in a worker; in this tree also on the batch, and in a CPU-only
    machine's worker."""
    import torch

    from vit_hub.data import batches

    dataset, transform = training_set(folder, keep=False)
    keys = [(round_index * samples + offset) % len(dataset) for offset in range(samples)]
    result = {}
    result["worker_ms"], made = worker_ms(dataset, keys)
    if has_batch_augmentation():
        collate = batches.CropBatches()
        groups = [made[start:start + batch] for start in range(0, len(made) - batch + 1, batch)][:batches_timed]
        transform.finish(*collate(groups[0])[::2])  # untimed first batch
        started = time.process_time()
        for group in groups:
            pixels, _, draws = collate(group)
            images = transform.finish(pixels, draws)
        assert images.dtype == torch.float32 and images.shape[1:] == (3, SIZE, SIZE)
        result["batch_ms"] = (time.process_time() - started) / (batch * len(groups)) * 1e3
        result["cpu_only_worker_ms"], _ = worker_ms(training_set(folder, keep=False, per_image=True)[0], keys)
    return result


def vit_hub_loader(folder: Path, batch: int, workers: int):
    """The trainer's loader on a CPU-only machine at this tree: batches of float32 images as
    the step gets them."""
    from vit_hub.data import batches

    dataset, transform = training_set(folder, keep=True, per_image=has_batch_augmentation())
    sampler = batches.EpochSampler(len(dataset), 0, batch, drop_last=True)
    if has_batch_augmentation():
        loader = batches.make_loader(dataset, batch, shuffle=False, seed=0, num_workers=workers, pin_memory=False,
                                     sampler=sampler, collate_fn=batches.CropBatches())
        return (transform.finish(pixels, draws) for pixels, _, draws in loader)
    loader = batches.make_loader(dataset, batch, shuffle=False, seed=0, num_workers=workers, pin_memory=False,
                                 sampler=sampler)
    return (transform.model_input(pixels, extra) for pixels, _, extra in loader)


def timm_loader(folder: Path, batch: int, workers: int, jitter: bool):
    import torch
    from timm.data import ImageDataset, create_loader
    from timm.data.transforms_factory import transforms_imagenet_train

    dataset = ImageDataset(str(folder))
    options = dict(scale=(0.5, 1.0), hflip=0.5, color_jitter=(0.3, 0.3, 0.3, 0.1), auto_augment="rand-m9-n2",
                   interpolation="bilinear", re_prob=0.25)
    loader = create_loader(dataset, input_size=(3, SIZE, SIZE), batch_size=batch, is_training=True, re_mode="const",
                           mean=MEAN, std=STD, num_workers=workers, device=torch.device("cpu"), use_prefetcher=True,
                           persistent_workers=False, **options)
    if jitter:  # what create_loader made, plus the colour jitter it leaves out next to RandAugment
        dataset.transform = transforms_imagenet_train(SIZE, force_color_jitter=True, use_prefetcher=True,
                                                      mean=MEAN, std=STD, **options)
    return (images for images, _ in loader)


def loader_rate(kind: str, folder: Path, batch: int, workers: int, batches_timed: int) -> dict:
    """img/s of a loader over `batches_timed` batches after one untimed batch."""
    import torch

    batches_of = (vit_hub_loader(folder, batch, workers) if kind == "vit_hub"
                  else timm_loader(folder, batch, workers, jitter=kind == TIMM_SAME))
    next(batches_of)  # workers started, first batch out of the way
    started = time.perf_counter()
    for _ in range(batches_timed):
        images = next(batches_of)
        assert images.dtype == torch.float32 and images.shape[1:] == (3, SIZE, SIZE)
    return {"img_s": batches_timed * batch / (time.perf_counter() - started)}


def step_rate(batch: int, steps: int) -> tuple[float, float]:
    """The vit_hub model's training steps on random tensors, one thread: (img/s, GFLOP/s)."""
    import torch

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


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, args.tree)
    folder = Path(args.folder)
    if args.child == "worker":
        result = worker_cpu(folder, args.round, args.samples, args.batch_size, args.batches)
    else:
        result = loader_rate(args.kind, folder, args.batch_size, args.workers, args.batches)
    print(json.dumps(result))


# The run: alternating rounds of child processes ----------------------------------------------------
def run_child(tree: Path, folder: Path, args: argparse.Namespace, *extra: str) -> dict:
    command = [sys.executable, __file__, "--tree", str(tree), "--folder", str(folder), "--batch-size",
               str(args.batch_size), "--samples", str(args.samples), "--batches", str(args.batches), *extra]
    environment = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=tree, check=False)
    if done.returncode:
        raise SystemExit(f"a measurement failed ({' '.join(extra)}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(reference: Path, folder: Path, args: argparse.Namespace) -> dict[str, list[dict]]:
    trees = {"reference": reference, "this tree": REPO}
    runs = [(f"worker:{name}", tree, ["--child", "worker"]) for name, tree in trees.items()]
    for workers in (0, args.workers):
        runs += [(f"loader{workers}:{name}", tree, ["--child", "loader", "--kind", "vit_hub", "--workers", str(workers)])
                 for name, tree in trees.items()]
        runs += [(f"loader{workers}:{kind}", REPO, ["--child", "loader", "--kind", kind, "--workers", str(workers)])
                 for kind in (TIMM_SAME, TIMM_OWN)]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for round_index in range(args.rounds):
        turn = round_index % len(runs)
        for name, tree, extra in runs[turn:] + runs[:turn]:
            results[name].append(run_child(tree, folder, args, *extra, "--round", str(round_index)))
    return results


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(results: dict[str, list[dict]], args: argparse.Namespace, step: tuple[float, float]) -> None:
    import timm
    import torch

    cores = os.cpu_count() or 1
    print(f"command: python bench/input_pipeline.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, timm {timm.__version__}, {cores} cores, load average "
          f"{'/'.join(f'{value:.2f}' for value in os.getloadavg()[:2])} (1/5 min, at the end)\n")
    print(f"{args.images} JPEGs of 256x256 at {SIZE}x{SIZE}, {args.rounds} rounds, medians (min-max)\n")
    old, new = results["worker:reference"], results["worker:this tree"]
    def against_reference(key: str) -> str:
        return spread([b[key] / a["worker_ms"] for a, b in zip(old, new)])

    print("| CPU ms per training image | in a worker | on the batch (CPU device) | worker vs reference |")
    print("|---|---|---|---|")
    print(f"| vit_hub at {args.reference} (reference) | {spread([r['worker_ms'] for r in old])} | (in the worker) | 1 |")
    print(f"| this tree, a GPU machine's worker | {spread([r['worker_ms'] for r in new])} | "
          f"{spread([r['batch_ms'] for r in new])} | {against_reference('worker_ms')} |")
    print(f"| this tree, a CPU-only machine's worker (per image, PIL) | {spread([r['cpu_only_worker_ms'] for r in new])} "
          f"| (in the worker) | {against_reference('cpu_only_worker_ms')} |\n")
    print(f"| loader | img/s per core (1 process, 1 thread) | img/s with {args.workers} workers / {cores} cores "
          "| per core vs the reference |")
    print("|---|---|---|---|")
    reference_rates = [r["img_s"] for r in results["loader0:reference"]]
    for name in ("reference", "this tree", TIMM_SAME, TIMM_OWN):
        single = [r["img_s"] for r in results[f"loader0:{name}"]]
        multi = [r["img_s"] / cores for r in results[f"loader{args.workers}:{name}"]]
        label = f"vit_hub at {args.reference}" if name == "reference" else name
        print(f"| {label} | {spread(single, 1)} | {spread(multi, 1)} | "
              f"{spread([a / b for a, b in zip(single, reference_rates)])} |")
    print(f"| model step alone (ViT-S/16, batch {args.step_batch}, fp32) | {step[0]:.1f} "
          f"({step[1]:.1f} GFLOP/s achieved) | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", metavar="REV", help="the vit_hub revision to compare with")
    parser.add_argument("--images", type=int, default=1200, help="JPEGs in the generated folder")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of every measurement")
    parser.add_argument("--samples", type=int, default=128, help="images a worker measurement reads")
    parser.add_argument("--batches", type=int, default=4, help="timed batches per loader or batch measurement")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for the loaders' second figure")
    parser.add_argument("--step-batch", type=int, default=8, help="batch of the model step row")
    parser.add_argument("--work", default="/tmp/vit_hub_input_bench", help="where the folder is generated")
    parser.add_argument("--child", choices=("worker", "loader"), help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="vit_hub", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if not args.reference:
        parser.error("--reference REV is required")
    folder = make_photos(Path(args.work) / f"photos_{args.images}", args.images)
    reference = Path(tempfile.mkdtemp(prefix="vit_hub_reference_"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(reference), args.reference],
                   check=True)
    try:
        results = measure(reference, folder, args)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(reference)], check=False)
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO))
    report(results, args, step_rate(args.step_batch, steps=3))


if __name__ == "__main__":
    main()
