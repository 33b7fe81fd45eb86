"""`vit-hub inspect` and the views drawn after training: read the images and weights the
analyses need, run `vit_hub.insight.views`, draw with `vit_hub.insight.figures`, and write the
figures and inspect.json into a folder (the layout names them: `layout.INSPECT_FIGURES`,
`ModelDir.inspect_report`).

Loading a model is the caller's: the command line resolves and loads `--model`, training
passes the model it just trained. So nothing here reaches the Hub.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from vit_hub.data.samples import BUNDLED_DIGITS, fits_bundled_digits, kept_samples
from vit_hub.errors import UserError
from vit_hub.insight.figures import draw_views, save_figure
from vit_hub.insight.views import ModelViews, compute_views, torch_attend, torch_weights
from vit_hub.layout import INSPECT_FIGURES, ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.storage import reading_safetensors, write_text_atomically

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
# Each view's figure is written to the file named after it (patch_filters -> patch_filters.png).
FIGURE_FILES = {Path(name).stem: name for name in INSPECT_FIGURES}


# Inputs -----------------------------------------------------------------------------------
def read_weights(model_dir: str | Path) -> dict[str, np.ndarray]:
    """model.safetensors of a model dir -> {name: array}, checked first (never a pickle)."""
    from safetensors.numpy import load_file

    path = ModelDir(model_dir).weights
    if not path.is_file():
        raise FileNotFoundError(f"expected weights at {path}, found nothing")
    with reading_safetensors(path):
        return load_file(str(path))


def default_data(config: ViTConfig, model_dir: str | Path | None = None) -> Path | list[Path] | None:
    """What a model is measured on when no --data is given: the bundled samples (MNIST digits)
    for a model of grayscale digits, else the sample images its model dir keeps (the validation
    images training kept, checked as the app checks them); None when there are none."""
    if fits_bundled_digits(config):
        return BUNDLED_DIGITS
    return kept_samples(model_dir) or None


def load_pixels(data: str | Path | list[Path], config: ViTConfig, count: int = 64, seed: int = 0,
                data_root: str | None = None, split: str = "val") -> tuple[np.ndarray, str]:
    """Up to `count` images of `data`, preprocessed as the config says -> ([B, C, H, W], description).

    data: a folder of images (searched recursively, class subfolders or not), anything
    `vit-hub train --data` takes ('mnist', a torchvision name), read through its `split`, or
    a model dir's kept samples (a list of image files, `default_data`).
    """
    from vit_hub.processing.preprocess import preprocess

    if count < 1:
        raise UserError(f"--samples: expected at least one image, got {count}")
    if isinstance(data, list):
        picks = _pick(len(data), count, seed)
        images, source = [data[i] for i in picks], f"{len(picks)} of the model's own sample images"
        return np.stack([preprocess(image, config) for image in images]), source
    folder = Path(data)
    if folder.is_dir():
        paths = _image_files(folder)
        if not paths:
            raise UserError(f"--data {data}: expected image files in the folder, found none")
        picks = _pick(len(paths), count, seed)
        images, source = [paths[i] for i in picks], f"{len(picks)} images from {folder.name or data}"
    else:
        from vit_hub.data.sources import load_splits  # torch and torchvision: only for a dataset by name

        dataset = load_splits(str(data), data_root).split(split)
        picks = _pick(len(dataset), count, seed)
        images, source = [dataset[i][0] for i in picks], f"{len(picks)} {split} images of {data}"
    return np.stack([preprocess(image, config) for image in images]), source


def _image_files(folder: Path) -> list[Path]:
    """Image files under `folder`, at any depth, sorted."""
    try:
        return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    except OSError as error:  # a subfolder that vanished or cannot be read
        raise UserError(f"--data {folder}: expected a folder of images that can be listed, found one that "
                        f"cannot ({error.strerror or type(error).__name__})") from None


def _pick(size: int, count: int, seed: int) -> list[int]:
    """`count` of range(size) (all when fewer), drawn by `seed`, in ascending order."""
    if size <= count:
        return list(range(size))
    return sorted(np.random.default_rng(seed).choice(size, size=count, replace=False).tolist())


# Output ----------------------------------------------------------------------------------
def check_out(out: str | Path) -> Path:
    """`--out` as a Path: a folder, new or existing, never a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out}: expected a folder (new or existing), found a file")
    return out


def write_views(views: ModelViews, out: str | Path) -> list[Path]:
    """The three figures (PNG) and inspect.json into `out`; returns the paths written, report first."""
    files = ModelDir(check_out(out))
    files.folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in draw_views(views).items():
        written.append(files.folder / FIGURE_FILES[name])
        save_figure(figure, written[-1])
    report = json.dumps(views.report(), indent=1) + "\n"
    write_text_atomically(files.inspect_report, report)
    return [files.inspect_report, *written]


# The command and training's views --------------------------------------------------------
def inspect_model(model: Any, out: str | Path, data: str | None = None, data_root: str | None = None,
                  split: str = "val", samples: int = 64, seed: int = 0,
                  model_dir: str | Path | None = None) -> list[Path]:
    """`vit-hub inspect`: views 1-3 of a loaded torch model, measured on `data` (default:
    `default_data`, the bundled digits or the model dir's own samples), written into `out`."""
    check_out(out)
    data = data or default_data(model.config, model_dir)
    if data is None:
        raise UserError("inspect: expected --data (a folder of images, 'mnist' or a torchvision name) to measure "
                        "attention distances on; the bundled samples are MNIST digits and fit only a digit model, "
                        f"and the model dir keeps no {ModelDir.samples}/ of its own")
    pixels, source = load_pixels(data, model.config, samples, seed, data_root, split)
    views = compute_views(model.config, torch_weights(model), torch_attend(model), pixels, source)
    return write_views(views, out)


def views_after_training(model: Any, out: Path, dataset: Any, samples: int = 64, seed: int = 0) -> list[Path]:
    """The views of a model that just finished training, written into its model dir. dataset:
    (pixels tensor [C, H, W], label) pairs as evaluation reads them (the validation split), or None.
    A failure here is reported as a warning whatever its kind: it must not cost the trained
    model its card."""
    try:
        pixels = None
        if dataset is not None and len(dataset):
            picks = _pick(len(dataset), samples, seed)
            pixels = np.stack([np.asarray(dataset[i][0], dtype=np.float32) for i in picks])
        note = f"{len(pixels)} validation images" if pixels is not None else "no validation images"
        return write_views(compute_views(model.config, torch_weights(model), torch_attend(model), pixels, note), out)
    except (ValueError, OSError) as error:
        print(f"warning: the views of what the model learned were not drawn: {error}", file=sys.stderr)
        return []
