"""Real uploads: other people's digit photos and drawings through the live app,
beside a small CNN trained on MNIST with the same canonicalisation.

    python bench/real_uploads.py --model models/vit-mnist --dev ../shared/realdigits-dev --json /tmp/real_uploads.json
                                 [--cache DIR] [--epochs 2] [--seed 0] [--threads 2]

`--dev` is a folder `<group>/<label>/<writer>__<name>.<ext>`: group `photo` (phone photos and
scans of ink on paper) or `painted` (drawn in a paint program); the writer is the public
repository the image came from, spelled `owner+name` (its MANIFEST.csv names each file's
source). The images are read where they lie, never copied.

Every image is scored four ways:
  torch   /predict of app.py serving the model on its torch backend, the file uploaded through
          gradio_client as a browser uploads it (bench/digit_uploads.py's live_app);
  onnx    the same on the ONNX backend (the model dir's ONNX graphs);
  sketch  /explain_drawing of the torch app, the image sent as the sketchpad's value (its
          background and composite), as if it had been drawn there;
  cnn       small_cnn, the reference a practitioner would try first: two conv layers with
            pooling and a linear head;
  resnet18  torchvision's ResNet-18 from scratch, its first convolution taking the config's
            channels (bench only, never used by vit_hub);
            both trained here (seeded, on the CPU, the same recipe) on the bundled MNIST training
            split canonicalised as the ViT's config says (`to_model_domain`, `model_pixels`),
            and fed each dev image through `vit_hub.processing.preprocess.preprocess`, the pipeline
            /predict uses.
A refusal (the app's gr.Error, such as "blank image", or a ValueError of preprocess) counts
as wrong and is also counted as refused. Printed: a Markdown table per writer with totals
per group, each reference's MNIST test accuracy, and the images the ViT (torch /predict) gets
wrong that a reference gets right and the reverse, with both predictions. `--json` writes
per-image records. The references' weights are cached in `--cache` under names hashing the
recipe and the canonical pixels of 256 MNIST digits, so a re-run with the same
canonicalisation only scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # app.py and bench/ live at the top level

from bench.digit_uploads import live_app, top_labels  # noqa: E402
from vit_hub.console import OneLineErrorParser, run_reporting_errors  # noqa: E402
from vit_hub.model.config import ViTConfig  # noqa: E402
from vit_hub.processing.postprocess import softmax  # noqa: E402
from vit_hub.processing.preprocess import model_pixels, preprocess, to_model_domain  # noqa: E402
from vit_hub.storage import replacing  # noqa: E402

GROUPS = ("photo", "painted")
ROUTES = {"torch": "ViT /predict torch", "onnx": "ViT /predict ONNX", "sketch": "ViT sketchpad", "cnn": "CNN",
          "resnet18": "ResNet-18"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
WRITER_MARK = "__"  # <owner>+<name>__<file>
LAYOUT = "<group>/<label>/<owner>+<name>__<file>"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "vit_hub_real_uploads"
FINGERPRINT_DIGITS = 256  # MNIST training digits whose canonical pixels name a reference's cache file
CANONICAL_WORKERS = 2
CANONICAL_CHUNK = 2000  # MNIST digits per task sent to a worker
BATCH = 128
LEARNING_RATE = 2e-3
WEIGHT_DECAY = 1e-4
EVAL_BATCH = 1000


# The dev folder ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DevImage:
    path: Path
    group: str  # photo or painted
    label: str
    writer: str  # owner/name of the repository the image came from

    @property
    def name(self) -> str:
        """As tables name it: group/label/file."""
        return f"{self.group}/{self.label}/{self.path.name}"


def dev_images(dev: Path) -> list[DevImage]:
    """Every image under `dev`, in LAYOUT (other files, such as MANIFEST.csv, are skipped)."""
    if not dev.is_dir():
        found = "a file" if dev.exists() else "nothing"
        raise NotADirectoryError(f"--dev: expected a folder of images in {LAYOUT}, found {found} at {dev}")
    images = []
    for path in sorted(dev.rglob("*")):
        if not (path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES):
            continue
        parts = path.relative_to(dev).parts
        if len(parts) != 3 or parts[0] not in GROUPS or not parts[1].isdigit() or WRITER_MARK not in parts[2]:
            raise ValueError(f"--dev: expected images in {LAYOUT} with group {' or '.join(GROUPS)}, "
                             f"found {'/'.join(parts)}")
        writer = parts[2].split(WRITER_MARK)[0].replace("+", "/", 1)
        images.append(DevImage(path, parts[0], parts[1], writer))
    if not images:
        raise ValueError(f"--dev: expected images in {LAYOUT}, found none in {dev}")
    return images


# Answers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One route's answer for one image: its top label, or why it refused the image."""

    predicted: str | None = None
    confidence: float | None = None
    refused: str | None = None

    def right(self, label: str) -> bool:
        return self.predicted == label

    def shown(self) -> str:
        return f"refused ({self.refused})" if self.refused else f"{self.predicted} ({self.confidence:.2f})"


def ask_app(client, endpoint: str, value) -> Answer:
    """One call of the app's `endpoint` with the default controls; a gr.Error is a refusal."""
    from gradio_client.exceptions import AppError

    try:
        result = client.predict(value, "mean", 0.0, 3, api_name=endpoint)
    except AppError as error:
        return Answer(refused=str(error))
    label, confidence = top_labels(result)[0]
    return Answer(label, round(confidence, 4))


def sketchpad_value(path: Path) -> dict:
    """The sketchpad's value as gradio_client sends it, with `path` drawn: background and composite."""
    from gradio_client import handle_file

    return {"background": handle_file(str(path)), "layers": [], "composite": handle_file(str(path))}


def score_through_app(images: list[DevImage], model: str) -> dict[str, list[Answer]]:
    """The torch app's /predict and /explain_drawing, then the ONNX app's /predict."""
    from gradio_client import handle_file

    answers = {}
    with live_app(model, "torch") as client:
        answers["torch"] = [ask_app(client, "/predict", handle_file(str(image.path))) for image in images]
        answers["sketch"] = [ask_app(client, "/explain_drawing", sketchpad_value(image.path)) for image in images]
    with live_app(model, "onnx") as client:
        answers["onnx"] = [ask_app(client, "/predict", handle_file(str(image.path))) for image in images]
    return answers


# The references ----------------------------------------------------------------------------
def small_cnn(config: ViTConfig) -> nn.Sequential:
    """LeNet-like, for the config's input and labels: a 5x5 and a 3x3 convolution (32 and 64
    channels), each followed by ReLU and 2x2 max pooling, then one linear layer (51k weights at
    28x28 with 10 classes)."""
    height, width = config.image_size
    return nn.Sequential(
        nn.Conv2d(config.in_channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # [B, 32, H/2, W/2]
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # [B, 64, H/4, W/4]
        nn.Flatten(), nn.Linear(64 * (height // 4) * (width // 4), config.num_classes),
    )


def resnet18(config: ViTConfig) -> nn.Module:
    """torchvision's ResNet-18, untrained, for the config's channels and labels (11.2M weights)."""
    from torchvision.models import resnet18 as torchvision_resnet18

    net = torchvision_resnet18(weights=None, num_classes=config.num_classes)
    net.conv1 = nn.Conv2d(config.in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return net


REFERENCES = {"cnn": small_cnn, "resnet18": resnet18}  # route -> the net, built for a config


def pixels_fingerprint(split, config: ViTConfig) -> str:
    """SHA-256 of FINGERPRINT_DIGITS digits of `split`, spread over it, as the config's pipeline
    feeds them: what a reference learns from changes only if this changes (the canonicalisation's
    code or the config's size, mode, mean or std), whatever else is edited around them."""
    step = len(split) // FINGERPRINT_DIGITS
    digits = np.stack([np.asarray(split[index][0]) for index in range(0, step * FINGERPRINT_DIGITS, step)])
    return hashlib.sha256(_canonical_chunk(digits, config).tobytes()).hexdigest()


def cache_file(cache: Path, name: str, config: ViTConfig, fingerprint: str, epochs: int, seed: int) -> Path:
    """Where the reference `name` trained by this recipe on pixels with this fingerprint is kept."""
    recipe = {"net": repr(REFERENCES[name](config)), "pixels": fingerprint, "epochs": epochs, "seed": seed,
              "batch": BATCH, "learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return cache / f"{name}_{digest}.safetensors"


def _canonical_chunk(digits: np.ndarray, config: ViTConfig) -> np.ndarray:
    """uint8 [n, 28, 28] MNIST digits -> float32 [n, C, H, W] as the ViT's pipeline feeds them."""
    return np.stack([model_pixels(to_model_domain(Image.fromarray(digit), config), config) for digit in digits])


def canonical_split(split, config: ViTConfig) -> tuple[np.ndarray, np.ndarray]:
    """A split of the bundled MNIST -> (float32 [N, C, H, W] canonicalised pixels, int64 [N] labels),
    canonicalised by CANONICAL_WORKERS processes."""
    digits = np.stack([np.asarray(split[index][0]) for index in range(len(split))])
    chunks = [digits[start:start + CANONICAL_CHUNK] for start in range(0, len(digits), CANONICAL_CHUNK)]
    with multiprocessing.get_context("spawn").Pool(CANONICAL_WORKERS) as pool:
        pixels = np.concatenate(pool.map(partial(_canonical_chunk, config=config), chunks))
    return pixels, np.asarray(split.targets, dtype=np.int64)


def train_reference(name: str, config: ViTConfig, pixels: np.ndarray, labels: np.ndarray, epochs: int,
                    seed: int) -> nn.Module:
    """AdamW with a one-cycle schedule, cross entropy, batches of BATCH, seeded."""
    torch.manual_seed(seed)
    net = REFERENCES[name](config).train()
    inputs, targets = torch.from_numpy(pixels), torch.from_numpy(labels)
    order = torch.Generator().manual_seed(seed)
    steps = epochs * math.ceil(len(inputs) / BATCH)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, LEARNING_RATE, total_steps=steps)
    for epoch in range(epochs):
        started = time.perf_counter()
        for batch in torch.randperm(len(inputs), generator=order).split(BATCH):
            optimizer.zero_grad()
            F.cross_entropy(net(inputs[batch]), targets[batch]).backward()
            optimizer.step()
            schedule.step()
        print(f"{ROUTES[name]} epoch {epoch + 1}/{epochs}: {time.perf_counter() - started:.0f} s", flush=True)
    return net.eval()


def probabilities(net: nn.Module, pixels: np.ndarray) -> np.ndarray:
    """float32 [N, C, H, W] -> [N, classes]."""
    with torch.inference_mode():
        batches = np.array_split(pixels, max(1, len(pixels) // EVAL_BATCH))
        logits = [net(torch.from_numpy(batch)).numpy() for batch in batches]
    return softmax(np.concatenate(logits))


def references(config: ViTConfig, cache: Path, epochs: int, seed: int) -> dict[str, tuple[nn.Module, float]]:
    """route -> (the reference, its MNIST test accuracy), each from the cache or trained and
    cached; MNIST is canonicalised once, and only if a reference has to be trained."""
    from safetensors.torch import load_file, safe_open, save_file

    from vit_hub.data.sources import load_splits

    splits = load_splits("mnist", val_split=0.0)
    fingerprint = pixels_fingerprint(splits.train, config)
    canonical = {}
    found = {}
    for name in REFERENCES:
        path = cache_file(cache, name, config, fingerprint, epochs, seed)
        net = REFERENCES[name](config).eval()
        if path.is_file():
            net.load_state_dict(load_file(path))
            with safe_open(path, "pt") as weights:
                found[name] = net, float(weights.metadata()["mnist_test_accuracy"])
            print(f"{ROUTES[name]}: cached {path.name} (MNIST test {found[name][1]:.4f})")
            continue
        if not canonical:
            started = time.perf_counter()
            canonical = {"train": canonical_split(splits.train, config), "test": canonical_split(splits.test, config)}
            print(f"MNIST canonicalised ({len(splits.train)} + {len(splits.test)} digits): "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        net = train_reference(name, config, *canonical["train"], epochs, seed)
        test_pixels, test_labels = canonical["test"]
        accuracy = float((probabilities(net, test_pixels).argmax(1) == test_labels).mean())
        cache.mkdir(parents=True, exist_ok=True)
        with replacing(path) as partial_file:
            save_file(net.state_dict(), str(partial_file), metadata={"mnist_test_accuracy": repr(accuracy)})
        print(f"{ROUTES[name]}: MNIST test {accuracy:.4f}, cached as {path}")
        found[name] = net, accuracy
    return found


def score_with_reference(images: list[DevImage], net: nn.Module, config: ViTConfig) -> list[Answer]:
    """Each image through `preprocess` (as /predict canonicalises it) and a reference net."""
    answers = []
    for image in images:
        try:
            pixels = preprocess(image.path, config)
        except ValueError as error:  # EmptyImageError among them
            answers.append(Answer(refused=str(error)))
            continue
        scores = probabilities(net, pixels[None])[0]
        best = int(scores.argmax())
        answers.append(Answer(config.labels[best], round(float(scores[best]), 4)))
    return answers


# Reporting ---------------------------------------------------------------------------------
def records(images: list[DevImage], answers: dict[str, list[Answer]]) -> list[dict]:
    """Per-image records: where it came from and each route's answer."""
    return [{"file": image.name, "group": image.group, "label": image.label, "writer": image.writer,
             **{route: dataclasses.asdict(answers[route][index]) for route in ROUTES if route in answers}}
            for index, image in enumerate(images)]


def tally(rows: list[dict]) -> dict:
    """Right and refused counts per route over some records."""
    return {"n": len(rows),
            **{route: {"right": sum(row[route]["predicted"] == row["label"] for row in rows),
                       "refused": sum(row[route]["refused"] is not None for row in rows)}
               for route in ROUTES if rows and route in rows[0]}}


def tallies(rows: list[dict]) -> tuple[list[dict], dict[str, dict]]:
    """(per writer, in group order then by name: {writer, group, n, route: counts}, per group)."""
    keys = sorted({(row["group"], row["writer"]) for row in rows},
                  key=lambda key: (GROUPS.index(key[0]), key[1].lower()))
    writers = [{"writer": writer, "group": group,
                **tally([row for row in rows if (row["group"], row["writer"]) == (group, writer)])}
               for group, writer in keys]
    groups = {group: tally([row for row in rows if row["group"] == group]) for group in GROUPS
              if any(row["group"] == group for row in rows)}
    return writers, groups


def markdown_table(writers: list[dict], groups: dict[str, dict]) -> str:
    """Right counts per route and writer, refusals in the last column; a total row per group."""
    routes = [route for route in ROUTES if writers and route in writers[0]]
    header = ["writer", "group", "n", *(ROUTES[route] for route in routes),
              f"refused ({' / '.join(routes)})"]

    def cells(counts: dict, bold: bool) -> list[str]:
        right = [f"{counts[route]['right']}/{counts['n']}" for route in routes]
        if bold:
            right = [f"**{cell}** ({counts[route]['right'] / counts['n']:.3f})" for cell, route in zip(right, routes)]
        return [str(counts["n"]), *right, " / ".join(str(counts[route]["refused"]) for route in routes)]

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [f"| {row['writer']} | {row['group']} | " + " | ".join(cells(row, False)) + " |" for row in writers]
    lines += [f"| **all {group}** | {group} | " + " | ".join(cells(counts, True)) + " |"
              for group, counts in groups.items()]
    return "\n".join(lines)


def differences(rows: list[dict], first: str, second: str, second_right: bool = True) -> list[str]:
    """Lines naming the images `first` gets wrong and `second` gets right (or also wrong:
    second_right=False), with both answers."""
    return [f"  {row['file']} (label {row['label']}): {ROUTES[first]} {Answer(**row[first]).shown()}, "
            f"{ROUTES[second]} {Answer(**row[second]).shown()}"
            for row in rows if row[first]["predicted"] != row["label"]
            and (row[second]["predicted"] == row["label"]) == second_right]


def disagreements(rows: list[dict]) -> list[str]:
    """Lines naming the images the app's routes (torch, ONNX, sketchpad) answer differently."""
    routes = [route for route in ("torch", "onnx", "sketch") if route in rows[0]]
    return [f"  {row['file']} (label {row['label']}): "
            + ", ".join(f"{ROUTES[route]} {Answer(**row[route]).shown()}" for route in routes)
            for row in rows if len({row[route]["predicted"] for route in routes}) > 1]


def report(rows: list[dict], accuracies: dict[str, float]) -> str:
    """The table, the references' MNIST accuracy, and the images behind the differences."""
    lines = [markdown_table(*tallies(rows)), "", "MNIST test, the same canonicalisation: " + ", ".join(
        f"{ROUTES[name]} {accuracy:.4f}" for name, accuracy in accuracies.items())]
    found = []
    for name in accuracies:
        found += [(f"ViT (/predict torch) wrong, {ROUTES[name]} right", differences(rows, "torch", name)),
                  (f"{ROUTES[name]} wrong, ViT right", differences(rows, name, "torch")),
                  (f"ViT and {ROUTES[name]} both wrong", differences(rows, "torch", name, second_right=False))]
    for title, images in [*found, ("the app's routes disagree", disagreements(rows))]:
        lines += ["", f"{title}: {len(images)}", *images]
    return "\n".join(lines)


def positive(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model dir or Hub repo id")
    parser.add_argument("--dev", type=Path, required=True, help=f"folder of images in {LAYOUT}")
    parser.add_argument("--json", type=Path, help="write the per-image records and the tables here")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"where the references' trained weights are kept (default {DEFAULT_CACHE})")
    parser.add_argument("--epochs", type=positive, default=2, help="the references' training epochs")
    parser.add_argument("--seed", type=int, default=0, help="the references' initialisation and batch order")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads while a reference trains")
    args = parser.parse_args()

    def run() -> None:
        from vit_hub.hub.pretrained import load_model

        images = dev_images(args.dev)
        config = load_model(args.model).config
        torch.set_num_threads(args.threads)
        nets = references(config, args.cache, args.epochs, args.seed)
        answers = {**{name: score_with_reference(images, net, config) for name, (net, _) in nets.items()},
                   **score_through_app(images, args.model)}
        rows = records(images, answers)
        print(report(rows, {name: accuracy for name, (_, accuracy) in nets.items()}))
        if args.json:
            writers, groups = tallies(rows)
            described = {name: {"epochs": args.epochs, "seed": args.seed, "mnist_test_accuracy": accuracy,
                                "weights": sum(weight.numel() for weight in net.parameters())}
                         for name, (net, accuracy) in nets.items()}
            args.json.write_text(json.dumps({"model": args.model, "dev": str(args.dev), "references": described,
                                             "groups": groups, "writers": writers, "images": rows}, indent=2) + "\n")

    sys.exit(run_reporting_errors(run))


if __name__ == "__main__":
    main()
