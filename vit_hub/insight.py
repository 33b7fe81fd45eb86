"""Inside the model: the ViT paper's own views of what a trained ViT learned (Dosovitskiy et al.,
2020, "An Image is Worth 16x16 Words", Figure 7 and Appendix D.7), for any vit_hub model.

    patch_filters        principal components of the patch projection's filters, with the
                         share of variance each explains
    position_similarity  cosine similarity of each position embedding to every other one
    attention_distance   how far (in input pixels) each head looks from its query patch,
                         weighted by the attention, averaged over images
    head_maps            for one image, each head's attention from the pooled token

The math is NumPy on arrays: weights as read from model.safetensors (`read_weights`) or a
model's state dict, attentions [depth, B, heads, T, T] from the torch model or the ONNX
graph. Figures are matplotlib. Only `torch_attend` and `views_after_training` touch torch,
and only when called.

Conventions. Token 0 is the class token, tokens 1..N the patches in row-major order. A
patch sits at its centre, in the model input's pixels. The class token has no position, so a
query's weights over the patch keys are renormalised to sum to 1 before distances are taken:
the distance is "how far away the patches it looks at are", whatever share it gives the
class token. The pooled token's own row (the class token, or the mean of the patch tokens'
rows for a model that pools by the mean) has no position either: its "distance" is the
spread of its attention, the expected distance between two patches drawn from it (0 for
attention on one patch, the grid's mean pairwise distance for uniform attention).
"""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from matplotlib.figure import Figure  # figures of their own: no pyplot state, no backend to choose
from matplotlib.lines import Line2D
import numpy as np  # noqa: E402
from matplotlib import colormaps
from PIL import Image  # noqa: E402

from .config import ViTConfig  # noqa: E402
from .rollout import as_numpy, colour_table, scale_maps  # noqa: E402
from .storage import reading_safetensors, write_text_atomically  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "samples"  # the bundled MNIST digits (a checkout)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
PATCH_WEIGHT = "patch_embedding.to_tokens.weight"
FIGURES = {"patch_filters": "patch_filters.png", "position_similarity": "position_similarity.png",
           "attention_distance": "attention_distance.png"}
REPORT = "inspect.json"
SHOWN_COMPONENTS = 28  # as many principal components as the paper's Figure 7 shows
LOCAL, GLOBAL = 0.5, 0.8  # a head is local below LOCAL x, global above GLOBAL x the uniform distance
BATCH = 16  # images per forward pass when measuring attention distances


# Inputs -----------------------------------------------------------------------------------
def read_weights(model_dir: str | Path) -> dict[str, np.ndarray]:
    """model.safetensors of a model dir -> {name: array}, checked first (never a pickle)."""
    from safetensors.numpy import load_file

    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"expected weights at {path}, found nothing")
    with reading_safetensors(path):
        return load_file(str(path))


def sincos_positions(grid_h: int, grid_w: int, dim: int) -> np.ndarray:
    """Fixed 2-D sine-cosine positions [grid_h * grid_w, dim], the NumPy twin of
    `model.sincos_position_embedding` (a test holds them equal)."""
    if dim % 4:
        raise ValueError(f"sincos positions need embed_dim divisible by 4, got {dim}")
    frequencies = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float32) / (dim // 4))  # [dim/4]
    ys, xs = np.meshgrid(np.arange(grid_h, dtype=np.float32), np.arange(grid_w, dtype=np.float32), indexing="ij")
    y_angles = ys.reshape(-1, 1) * frequencies  # [N, dim/4]
    x_angles = xs.reshape(-1, 1) * frequencies
    return np.concatenate([np.sin(y_angles), np.cos(y_angles), np.sin(x_angles), np.cos(x_angles)], axis=1)


def default_data(config: ViTConfig) -> Path | None:
    """The bundled samples (MNIST digits) for a model of grayscale digits; None for any other."""
    digits = config.in_channels == 1 and config.labels == [str(d) for d in range(10)]
    return SAMPLES if digits and SAMPLES.is_dir() else None


def load_pixels(data: str | Path, config: ViTConfig, count: int = 64, seed: int = 0,
                data_root: str | None = None, split: str = "val") -> tuple[np.ndarray, str]:
    """Up to `count` images of `data`, preprocessed as the config says -> ([B, C, H, W], description).

    data: a folder of images (searched recursively, class subfolders or not), or anything
    `vit-hub train --data` takes ('mnist', a torchvision name), read through its `split`.
    """
    from .preprocess import preprocess

    if count < 1:
        raise ValueError(f"--samples: expected at least one image, got {count}")
    folder = Path(data)
    if folder.is_dir():
        paths = _image_files(folder)
        if not paths:
            raise ValueError(f"--data {data}: expected image files in the folder, found none")
        picks = _pick(len(paths), count, seed)
        images, source = [paths[i] for i in picks], f"{len(picks)} images from {folder.name or data}"
    else:
        from .data import load_splits

        splits = load_splits(str(data), data_root)
        dataset = splits.split(split)
        picks = _pick(len(dataset), count, seed)
        images, source = [dataset[i][0] for i in picks], f"{len(picks)} {split} images of {data}"
    return np.stack([preprocess(image, config) for image in images]), source


def _image_files(folder: Path) -> list[Path]:
    """Image files under `folder`, at any depth, sorted."""
    try:
        return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    except OSError as error:  # a subfolder that vanished or cannot be read
        raise ValueError(f"--data {folder}: expected a folder of images that can be listed, found one that "
                         f"cannot ({error.strerror or type(error).__name__})") from None


def _pick(size: int, count: int, seed: int) -> list[int]:
    """`count` of range(size) (all when fewer), drawn by `seed`, in ascending order."""
    if size <= count:
        return list(range(size))
    return sorted(np.random.default_rng(seed).choice(size, size=count, replace=False).tolist())


# 1. Patch-embedding filters ---------------------------------------------------------------
@dataclass
class PatchFilters:
    """Principal components of the patch filters, or why there are none."""

    components: np.ndarray | None  # [k, C, h, w], each unit length, best first
    variance: np.ndarray | None  # [k], share of the filters' variance each explains
    note: str  # what is shown, or why nothing is
    filters: int = 0  # how many filters (embed_dim)


def patch_filters(weights: dict[str, np.ndarray] | None, config: ViTConfig,
                  count: int = SHOWN_COMPONENTS) -> PatchFilters:
    """The first `count` principal components of the linear patch projection's filters."""
    if config.patch_embedding == "convstem":
        return PatchFilters(None, None, "this model has a convolutional stem (3x3 stride-2 convolutions with "
                            "BatchNorm and ReLU, then a 1x1 projection): no single linear filter per patch, "
                            "so the paper's filter view does not apply")
    if weights is None:
        return PatchFilters(None, None, "the filters need the model's weights (model.safetensors), "
                            "which this backend does not have")
    kernel = _patch_kernel(weights, config)  # [D, C', p_h, p_w]
    note = f"the {kernel.shape[0]} filters of the patch projection"
    if config.patch_embedding == "shifted":
        kernel = shifted_window(kernel, config.in_channels)
        note = (f"the {kernel.shape[0]} filters of the shifted patch projection, drawn over the "
                f"{kernel.shape[-2]}x{kernel.shape[-1]} pixels each token sees (its patch, and half a patch "
                f"around it through the four shifted copies)")
    components, variance = principal_components(kernel.reshape(len(kernel), -1), count)
    return PatchFilters(components.reshape(-1, *kernel.shape[1:]), variance, note, len(kernel))


def _patch_kernel(weights: dict[str, np.ndarray], config: ViTConfig) -> np.ndarray:
    channels = config.in_channels * (5 if config.patch_embedding == "shifted" else 1)
    expected = (config.embed_dim, channels, *config.patch_size)
    kernel = weights.get(PATCH_WEIGHT)
    if kernel is None or tuple(kernel.shape) != expected:
        found = "no such weight" if kernel is None else f"shape {list(kernel.shape)}"
        raise ValueError(f"expected the patch projection {PATCH_WEIGHT} of shape {list(expected)} "
                         f"in the weights, found {found}")
    return np.asarray(kernel, dtype=np.float64)


def shifted_window(kernel: np.ndarray, channels: int) -> np.ndarray:
    """Shifted patch tokenization's kernel [D, 5C, p_h, p_w] -> the same linear map on the
    original image [D, C, p_h + 2 dy, p_w + 2 dx] (dy, dx = half a patch).

    The model stacks the image with four copies moved half a patch towards each corner
    (`model.PatchEmbedding`), so the token of a patch reads a window reaching half a patch
    beyond it: the unshifted copy's kernel lands in the window's middle, the shifted ones'
    in its four corners, and where they overlap they add up.
    """
    dim, _, patch_h, patch_w = kernel.shape
    dy, dx = patch_h // 2, patch_w // 2
    # Where each copy's kernel lands in the window, in the model's channel order.
    offsets = [(dy, dx), (0, 0), (0, 2 * dx), (2 * dy, 0), (2 * dy, 2 * dx)]
    copies = kernel.reshape(dim, 5, channels, patch_h, patch_w)
    window = np.zeros((dim, channels, patch_h + 2 * dy, patch_w + 2 * dx))
    for copy, (top, left) in enumerate(offsets):  # five fixed copies
        window[..., top:top + patch_h, left:left + patch_w] += copies[:, copy]
    return window


def principal_components(rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """PCA of `rows` [n, F] -> (components [k, F] orthonormal, variance shares [k]), k <= count.

    Rows are centred first; shares are of the total variance, so they sum to at most 1.
    Each component's sign is fixed (its largest entry is positive), so runs agree.
    """
    centred = rows - rows.mean(axis=0, keepdims=True)
    _, singular, components = np.linalg.svd(centred, full_matrices=False)  # components [r, F]
    total = float((singular**2).sum())
    shares = singular**2 / total if total > 0 else np.zeros_like(singular)
    components, shares = components[:count], shares[:count]
    largest = np.take_along_axis(components, np.abs(components).argmax(axis=1)[:, None], axis=1)  # [k, 1]
    return components * np.where(largest < 0, -1.0, 1.0), shares


# 2. Position-embedding similarity ---------------------------------------------------------
def position_table(weights: dict[str, np.ndarray] | None, config: ViTConfig) -> np.ndarray | None:
    """The position embeddings [N, D]: computed for sin-cos, read for learned (None without weights)."""
    if config.pos_embedding == "sincos":
        return sincos_positions(*config.grid_size, config.embed_dim)
    if weights is None:
        return None
    table = weights.get("pos_embedding")
    expected = (1, config.num_patches, config.embed_dim)
    if table is None or tuple(table.shape) != expected:
        found = "no such weight" if table is None else f"shape {list(table.shape)}"
        raise ValueError(f"expected learned positions pos_embedding of shape {list(expected)} in the weights, "
                         f"found {found}")
    return np.asarray(table[0], dtype=np.float64)


def position_similarity(positions: np.ndarray) -> np.ndarray:
    """[N, D] embeddings -> [N, N] cosine similarity of every position to every other."""
    positions = np.asarray(positions, dtype=np.float64)
    if positions.ndim != 2:
        raise ValueError(f"expected position embeddings [patches, dim], got shape {list(positions.shape)}")
    unit = positions / np.maximum(np.linalg.norm(positions, axis=1, keepdims=True), 1e-12)
    return unit @ unit.T


# 3. Mean attention distance ---------------------------------------------------------------
def patch_centres(config: ViTConfig) -> np.ndarray:
    """[N, 2] (y, x) centre of every patch in input pixels, row-major like the tokens."""
    (grid_h, grid_w), (patch_h, patch_w) = config.grid_size, config.patch_size
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    return np.stack([(rows.ravel() + 0.5) * patch_h, (cols.ravel() + 0.5) * patch_w], axis=1)


def patch_distances(config: ViTConfig) -> np.ndarray:
    """[N, N] Euclidean distance in pixels between patch centres."""
    centres = patch_centres(config)
    return np.linalg.norm(centres[:, None] - centres[None], axis=-1)


def uniform_distance(config: ViTConfig) -> float:
    """The attention distance of uniform attention: the mean distance over all pairs of patches."""
    return float(patch_distances(config).mean())


def pooled_token(config: ViTConfig) -> str:
    """What the head reads, in words: the token whose row the pooled views show."""
    return "class token" if config.pooling == "cls" else "mean of the patch tokens (the model has no class-token head)"


def _patch_keys(attentions: Any, config: ViTConfig) -> np.ndarray:
    """[..., T, T] -> [..., T, N]: each query's weights over the patch keys, summing to 1."""
    attentions = as_numpy(attentions).astype(np.float64)
    tokens = config.num_tokens
    if attentions.ndim < 3 or attentions.shape[-2:] != (tokens, tokens):
        raise ValueError(f"expected attentions [..., {tokens}, {tokens}] (class token + {config.num_patches} "
                         f"patches), got shape {list(attentions.shape)}")
    keys = attentions[..., 1:]
    return keys / np.maximum(keys.sum(axis=-1, keepdims=True), 1e-12)


def _pooled_row(keys: np.ndarray, pooling: str) -> np.ndarray:
    """[..., T, N] -> [..., N]: the class token's row, or the mean of the patch tokens' rows."""
    return keys[..., 0, :] if pooling == "cls" else keys[..., 1:, :].mean(axis=-2)


def attention_distance(attentions: Any, config: ViTConfig) -> tuple[np.ndarray, np.ndarray]:
    """Attention distances in pixels of [depth, B, heads, T, T] attentions -> two [depth, B, heads]:

    - patch queries: sum over keys of weight x distance(query, key), averaged over the queries;
    - the pooled token: the spread of its row, sum over key pairs of w_i w_j distance(i, j).
    """
    keys = _patch_keys(attentions, config)  # [L, B, H, T, N]
    distances = patch_distances(config)  # [N, N]
    per_query = (keys[..., 1:, :] * distances).sum(axis=-1)  # [L, B, H, N]
    pooled = _pooled_row(keys, config.pooling)  # [L, B, H, N]
    spread = np.einsum("...i,ij,...j->...", pooled, distances, pooled)  # [L, B, H]
    return per_query.mean(axis=-1), spread


def mean_attention_distance(attend: Callable[[np.ndarray], Any], pixels: np.ndarray,
                            config: ViTConfig) -> tuple[np.ndarray, np.ndarray]:
    """`attention_distance` averaged over images -> (patch queries [depth, heads], pooled [depth, heads]).

    attend: float32 [b, C, H, W] -> attentions [depth, b, heads, T, T] (torch or ONNX Runtime).
    """
    if len(pixels) == 0:
        raise ValueError("expected at least one image to measure attention distances on, got none")
    parts = [attention_distance(attend(pixels[start:start + BATCH]), config)
             for start in range(0, len(pixels), BATCH)]  # batches bound the memory
    per_query = np.concatenate([part[0] for part in parts], axis=1)  # [L, B, H]
    pooled = np.concatenate([part[1] for part in parts], axis=1)
    return per_query.mean(axis=1), pooled.mean(axis=1)


# 4. Per-head attention maps ---------------------------------------------------------------
def head_maps(attentions: Any, config: ViTConfig) -> np.ndarray:
    """[depth, B, heads, T, T] -> [depth, B, heads, grid_h, grid_w]: each head's attention from
    the pooled token (the class token, or the mean of the patch tokens' rows) over the patches,
    every map scaled to [0, 1]."""
    rows = _pooled_row(_patch_keys(attentions, config), config.pooling)  # [L, B, H, N]
    return scale_maps(rows.reshape(*rows.shape[:-1], *config.grid_size))


def head_grid(view: Image.Image, maps: np.ndarray, tile_height: int = 72, alpha: float = 0.55,
              colormap: str = "jet") -> Image.Image:
    """maps [depth, heads, grid_h, grid_w] in [0, 1] over `view` -> one RGB image: a row per layer
    (first at the top), a column per head. Patches are drawn as blocks (each has one weight)."""
    depth, heads, grid_h, grid_w = maps.shape
    cell = max(1, round(tile_height / grid_h))  # pixels per patch side
    tile_h, tile_w = grid_h * cell, grid_w * cell
    base = np.asarray(view.convert("RGB").resize((tile_w, tile_h), Image.Resampling.BILINEAR))
    colours = colour_table(colormap)[(np.clip(maps, 0.0, 1.0) * 255.0).round().astype(np.uint8)]  # [L, H, gh, gw, 3]
    blocks = colours.repeat(cell, axis=2).repeat(cell, axis=3)  # [L, H, tile_h, tile_w, 3]
    weight = round(alpha * 256)  # blend in 8-bit fixed point: uint16 holds 255 * 256
    tiles = (blocks.astype(np.uint16) * weight + base.astype(np.uint16) * (256 - weight) + 128) >> 8
    gap = 3
    mosaic = np.full((depth, tile_h + gap, heads, tile_w + gap, 3), 255, dtype=np.uint8)
    mosaic[:, :tile_h, :, :tile_w] = tiles.transpose(0, 2, 1, 3, 4)
    mosaic = mosaic.reshape(depth * (tile_h + gap), heads * (tile_w + gap), 3)
    return Image.fromarray(mosaic[:-gap, :-gap])


# All views of one model -------------------------------------------------------------------
@dataclass
class ModelViews:
    """Views 1-3 of one model, their numbers and the notes that say what they rest on."""

    config: ViTConfig
    filters: PatchFilters
    similarity: np.ndarray | None  # [N, N]
    position_note: str
    distance: np.ndarray | None  # [depth, heads] px, patch queries
    pooled_distance: np.ndarray | None  # [depth, heads] px, the pooled token's spread
    data_note: str  # which images the distances were measured on, or why none

    def report(self) -> dict[str, Any]:
        """The numbers as JSON-native values (what inspect.json holds)."""
        config, filters = self.config, self.filters
        return {
            "patch_embedding": config.patch_embedding,
            "patch_filter_variance": _rounded(filters.variance, down=True),  # still sums to <= 1
            "patch_filter_note": filters.note,
            "pos_embedding": config.pos_embedding,
            "grid_size": list(config.grid_size),
            "patch_size": list(config.patch_size),
            "position_similarity": _rounded(self.similarity),
            "position_note": self.position_note,
            "mean_attention_distance": _rounded(self.distance),
            "pooled_attention_distance": _rounded(self.pooled_distance),
            "pooled_token": pooled_token(config),
            "uniform_attention_distance": round(uniform_distance(config), 4),
            "data": self.data_note,
            "readings": self.readings(),
        }

    def readings(self) -> dict[str, str]:
        return {"patch_filters": read_filters(self.filters),
                "position_similarity": read_positions(self.similarity, self.config, self.position_note),
                "attention_distance": read_distances(self.distance, self.pooled_distance, self.config,
                                                     self.data_note)}

    def figures(self) -> dict[str, Figure]:
        return {"patch_filters": plot_patch_filters(self.filters, self.config),
                "position_similarity": plot_position_similarity(self.similarity, self.config, self.position_note),
                "attention_distance": plot_attention_distance(self.distance, self.pooled_distance, self.config,
                                                              self.data_note)}

    def images(self) -> dict[str, Image.Image]:
        """The figures as PIL images (for the app)."""
        return {name: figure_image(figure) for name, figure in self.figures().items()}

    def write(self, out: str | Path) -> list[Path]:
        """The three figures (PNG) and inspect.json into `out`; returns the paths written."""
        out = check_out(out)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, figure in self.figures().items():
            written.append(out / FIGURES[name])
            save_figure(figure, written[-1])
        write_text_atomically(out / REPORT, json.dumps(self.report(), indent=1) + "\n")
        return [out / REPORT, *written]


def check_out(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out}: expected a folder (new or existing), found a file")
    return out


def compute_views(config: ViTConfig, weights: dict[str, np.ndarray] | None,
                  attend: Callable[[np.ndarray], Any] | None = None, pixels: np.ndarray | None = None,
                  data_note: str = "") -> ModelViews:
    """Views 1-3. weights: None when only an ONNX graph is at hand (filters and learned positions
    then say so). attend and pixels: how to get attentions and of which images (None: no data)."""
    positions = position_table(weights, config)
    if config.pos_embedding == "sincos":
        position_note = "fixed sin-cos positions, computed rather than learned"
    elif positions is None:
        position_note = ("learned positions need the model's weights (model.safetensors), "
                         "which this backend does not have")
    else:
        position_note = "learned positions"
    distance = pooled = None
    if attend is not None and pixels is not None:
        distance, pooled = mean_attention_distance(attend, pixels, config)
    return ModelViews(config, patch_filters(weights, config),
                      None if positions is None else position_similarity(positions), position_note,
                      distance, pooled, data_note or "no images given")


def _rounded(array: np.ndarray | None, down: bool = False) -> Any:
    """To 4 decimals (down: rounded towards zero) as nested lists; None stays None."""
    if array is None:
        return None
    scaled = np.asarray(array, dtype=np.float64) * 1e4
    return ((np.floor(scaled) if down else np.round(scaled)) / 1e4).tolist()


# Readings: one sentence per view, from the numbers ----------------------------------------
def read_filters(filters: PatchFilters) -> str:
    if filters.variance is None:
        return f"Not shown: {filters.note}."
    top = min(3, len(filters.variance))
    return (f"The first {top} principal components explain {filters.variance[:top].sum():.0%} of the variance "
            f"of {filters.note}.")


def read_positions(similarity: np.ndarray | None, config: ViTConfig, note: str) -> str:
    if similarity is None:
        return f"Not shown: {note}."
    cells = patch_centres(config) / np.asarray(config.patch_size)  # [N, 2] in grid steps
    steps = np.linalg.norm(cells[:, None] - cells[None], axis=-1)  # [N, N]
    near, far = similarity[np.isclose(steps, 1.0)], similarity[steps >= steps.max() / 2]
    if near.size == 0:
        return f"A single patch position: nothing to compare ({note})."
    verdict = ("nearby positions have more similar embeddings than distant ones"
               if near.mean() > far.mean() + 0.1 else "the embeddings show no clear sense of distance")
    return (f"Neighbouring patches' position embeddings have cosine similarity {near.mean():.2f} on average, "
            f"patches half the grid or more apart {far.mean():.2f}: {verdict} ({note}).")


def read_distances(distance: np.ndarray | None, pooled: np.ndarray | None, config: ViTConfig,
                   data_note: str) -> str:
    if distance is None:
        return f"Not measured: {data_note}."
    uniform, depth = uniform_distance(config), len(distance)
    first, last = distance[0], distance[-1]
    early = distance[: max(1, depth // 2)].ravel()
    if (early < LOCAL * uniform).any() and (early > GLOBAL * uniform).any():
        early_words = "early layers mix local and global heads"
    elif (early < LOCAL * uniform).all():
        early_words = "early layers are local"
    elif (early > GLOBAL * uniform).all():
        early_words = "early layers are already global"
    else:
        early_words = "early layers look at middle distances"
    late_words = "later layers are global" if (last > GLOBAL * uniform).all() else "later layers keep local heads"
    token = pooled_token(config).split(" (")[0]
    return (f"Layer 1's heads attend {first.min():.1f} to {first.max():.1f} px away, layer {depth}'s "
            f"{last.min():.1f} to {last.max():.1f} px (uniform attention: {uniform:.1f} px): "
            f"{early_words}; {late_words}. The {token}'s attention spreads over {pooled[0].mean():.1f} px "
            f"in layer 1 and {pooled[-1].mean():.1f} px in layer {depth} (mean of the heads).")


# Figures -----------------------------------------------------------------------------------
def plot_patch_filters(filters: PatchFilters, config: ViTConfig) -> Figure:
    """The principal components as small images (one per channel for RGB), share of variance above each."""
    if filters.components is None:
        return _note_figure("Patch-embedding filters", filters.note)
    count, channels, height, width = filters.components.shape
    columns = min(7, count)
    rows = math.ceil(count / columns)
    mosaic = _filter_mosaic(filters.components, columns)
    cell_h, cell_w = height + 4, channels * (width + 1) + 1
    figure = Figure(figsize=(1.0 + 0.35 * columns * channels * width / 4, 1.0 + 0.45 * rows * height / 4))
    axis = figure.subplots()
    axis.imshow(mosaic, cmap=_diverging(), vmin=-1, vmax=1, interpolation="nearest")
    for index, share in enumerate(filters.variance):  # a label over each component
        row, column = divmod(index, columns)
        axis.text(column * cell_w + cell_w / 2 - 0.5, row * cell_h + 1.2, f"{index + 1}: {share:.1%}",
                  ha="center", va="center", fontsize=6)
    axis.set_axis_off()
    names = " (R, G, B side by side)" if channels == 3 else ""
    axis.set_title(f"Patch-embedding filters: first {count} principal components{names}\n"
                   f"with the share of variance each explains", fontsize=9)
    figure.tight_layout()
    return figure


def _filter_mosaic(components: np.ndarray, columns: int) -> np.ndarray:
    """[k, C, h, w] -> one 2-D array: components in a grid, channels side by side, each component
    scaled by its largest magnitude, NaN (drawn white) in the gaps and the label row above."""
    count, channels, height, width = components.shape
    scaled = components / np.maximum(np.abs(components).max(axis=(1, 2, 3), keepdims=True), 1e-12)
    tiles = np.pad(scaled, ((0, 0), (0, 0), (3, 1), (1, 0)), constant_values=np.nan)  # label row on top
    cells = tiles.transpose(0, 2, 1, 3).reshape(count, height + 4, channels * (width + 1))  # [k, ch, cw]
    cells = np.pad(cells, ((0, 0), (0, 0), (0, 1)), constant_values=np.nan)
    rows = math.ceil(count / columns)
    cells = np.pad(cells, ((0, rows * columns - count), (0, 0), (0, 0)), constant_values=np.nan)
    cell_h, cell_w = cells.shape[1:]
    return cells.reshape(rows, columns, cell_h, cell_w).transpose(0, 2, 1, 3).reshape(rows * cell_h, columns * cell_w)


def plot_position_similarity(similarity: np.ndarray | None, config: ViTConfig, note: str) -> Figure:
    """One small heat map per patch position (at its place in the grid): its cosine similarity to every position."""
    if similarity is None:
        return _note_figure("Position-embedding similarity", note)
    grid_h, grid_w = config.grid_size
    tiles = similarity.reshape(grid_h, grid_w, grid_h, grid_w)  # [row, col, row', col']
    tiles = np.pad(tiles, ((0, 0), (0, 0), (0, 1), (0, 1)), constant_values=np.nan)
    mosaic = tiles.transpose(0, 2, 1, 3).reshape(grid_h * (grid_h + 1), grid_w * (grid_w + 1))[:-1, :-1]
    scale = min(6.0, max(3.0, 0.4 * max(grid_h, grid_w)))
    longer = max(grid_h, grid_w)
    figure = Figure(figsize=(scale * grid_w / longer + 1.4, scale * grid_h / longer + 0.8))
    axis = figure.subplots()
    low = min(0.0, float(np.nanmin(mosaic)))  # sin-cos positions never go negative: use the range
    shown = axis.imshow(mosaic, cmap="viridis", vmin=low, vmax=1, interpolation="nearest")
    axis.set_xticks(np.arange(grid_w) * (grid_w + 1) + (grid_w - 1) / 2, np.arange(1, grid_w + 1), fontsize=7)
    axis.set_yticks(np.arange(grid_h) * (grid_h + 1) + (grid_h - 1) / 2, np.arange(1, grid_h + 1), fontsize=7)
    axis.set_xlabel("input patch column")
    axis.set_ylabel("input patch row")
    axis.tick_params(length=0)
    axis.set_frame_on(False)
    figure.colorbar(shown, ax=axis, fraction=0.046, pad=0.04, label="cosine similarity")
    axis.set_title(f"Position-embedding similarity ({config.pos_embedding})", fontsize=9)
    figure.tight_layout()
    return figure


def plot_attention_distance(distance: np.ndarray | None, pooled: np.ndarray | None, config: ViTConfig,
                            data_note: str) -> Figure:
    """Mean attention distance against depth, one dot per head: patch queries, and the pooled token's spread."""
    if distance is None:
        return _note_figure("Mean attention distance", data_note)
    depth, heads = distance.shape
    layers = np.broadcast_to(np.arange(1, depth + 1)[:, None], (depth, heads))
    colours = np.broadcast_to(np.arange(heads)[None], (depth, heads))
    uniform = uniform_distance(config)
    top = 1.1 * max(float(distance.max()), float(pooled.max()), uniform)
    figure = Figure(figsize=(8.5, 3.6))
    axes = figure.subplots(1, 2, sharey=True)
    panels = ((axes[0], distance, "patch queries: distance to the keys"),
              (axes[1], pooled, f"{pooled_token(config).split(' (')[0]}: spread of its attention"))
    for axis, values, title in panels:  # two panels
        points = axis.scatter(layers.ravel(), values.ravel(), c=colours.ravel(), cmap="tab10",
                              vmin=0, vmax=9, s=18)
        axis.axhline(uniform, color="grey", linestyle="--", linewidth=1, label=f"uniform attention ({uniform:.1f} px)")
        axis.set_xlabel("network depth (layer)")
        axis.set_xticks(np.arange(1, depth + 1))
        axis.set_ylim(0, top)
        axis.set_title(title, fontsize=9)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("mean attention distance (pixels)")
    axes[0].legend(fontsize=7, loc="lower right")
    if heads <= 10:
        handles = [Line2D([], [], marker="o", linestyle="", color=points.cmap(points.norm(head)))
                   for head in range(heads)]  # legend entries
        axes[1].legend(handles, [f"head {h + 1}" for h in range(heads)], fontsize=7, loc="lower right", ncol=2)
    figure.suptitle(f"Mean attention distance per head ({data_note})", fontsize=9)
    figure.tight_layout()
    return figure


def _note_figure(title: str, note: str) -> Figure:
    """A small figure that says why a view is not shown (instead of a fake one)."""
    import textwrap

    figure = Figure(figsize=(6, 1.8))
    axis = figure.subplots()
    axis.set_axis_off()
    axis.text(0.5, 0.5, f"{title}: not shown\n\n" + textwrap.fill(note, 80), ha="center", va="center", fontsize=8)
    return figure


def _diverging():
    return colormaps["RdBu_r"].with_extremes(bad="white")  # NaN gaps drawn white


def save_figure(figure: Figure, path: Path) -> None:
    figure.savefig(path, dpi=110)


def figure_image(figure: Figure) -> Image.Image:
    buffer = io.BytesIO()
    save_figure(figure, buffer)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB")


# With the torch model ----------------------------------------------------------------------
def torch_attend(model: Any) -> Callable[[np.ndarray], np.ndarray]:
    """A torch VisionTransformer as `attend`: float32 [b, C, H, W] -> attentions [depth, b, heads, T, T]."""
    import torch

    device = next(model.parameters()).device

    def attend(pixels: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            _, attentions = model.eval()(torch.from_numpy(pixels).to(device), output_attentions=True)
        return torch.stack(attentions).float().cpu().numpy()

    return attend


def torch_weights(model: Any) -> dict[str, np.ndarray]:
    """A torch model's parameters and saved buffers as arrays (what model.safetensors holds)."""
    return {name: tensor.detach().float().cpu().numpy() for name, tensor in model.state_dict().items()}


def inspect_model(reference: str | Path, out: str | Path, data: str | None = None, data_root: str | None = None,
                  split: str = "val", samples: int = 64, seed: int = 0) -> list[Path]:
    """`vit-hub inspect`: views 1-3 of a model dir or Hub repo id written into `out`."""
    from .hub import resolve_model_dir
    from .pretrained import load_model

    check_out(out)
    model_dir = resolve_model_dir(reference)
    model = load_model(model_dir)
    data = data or default_data(model.config)
    if data is None:
        raise ValueError("inspect: expected --data (a folder of images, 'mnist' or a torchvision name) to measure "
                         "attention distances on; the bundled samples are MNIST digits and fit only a digit model")
    pixels, source = load_pixels(data, model.config, samples, seed, data_root, split)
    views = compute_views(model.config, read_weights(model_dir), torch_attend(model), pixels, source)
    return views.write(out)


def views_after_training(model: Any, out: Path, dataset: Any, samples: int = 64, seed: int = 0) -> list[Path]:
    """The views of a model that just finished training, written into its model dir. dataset:
    (pixels tensor [C, H, W], label) pairs as evaluation reads them (the validation split), or None.
    A failure here is reported as a warning: it must not cost the trained model its card."""
    try:
        pixels = None
        if dataset is not None and len(dataset):
            picks = _pick(len(dataset), samples, seed)
            pixels = np.stack([np.asarray(dataset[i][0], dtype=np.float32) for i in picks])
        note = f"{len(pixels)} validation images" if pixels is not None else "no validation images"
        return compute_views(model.config, torch_weights(model), torch_attend(model), pixels, note).write(out)
    except (ValueError, OSError) as error:
        print(f"warning: the views of what the model learned were not drawn: {error}", file=sys.stderr)
        return []
