"""Inside the model: the ViT paper's own views of what a trained ViT learned (Dosovitskiy et al.,
2021, "An Image is Worth 16x16 Words", Figure 7 and Appendix D.7), measured for any vit_hub model.

    patch_filters        principal components of the patch projection's filters, with the
                         share of variance each explains
    position_similarity  cosine similarity of each position embedding to every other one
    attention_distance   how far (in input pixels) each head looks from its query patch,
                         weighted by the attention, averaged over images
    head_maps            for one image, each head's attention from the pooled token

This module is the analyses alone: NumPy on arrays, no files and no drawing. Weights come as
{name: array} (a model dir's model.safetensors, or a model's state dict), attentions
[depth, B, heads, T, T] from the torch model or the ONNX graph. `vit_hub.insight.figures` draws
the views; `vit_hub.insight.inspect` reads images and weights and writes the figures and inspect.json.
Only `torch_attend` and `torch_weights` touch torch, and only when called: the app's ONNX
backend runs these analyses without torch.

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

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vit_hub.errors import UserError
from vit_hub.explain.rollout import scale_maps
from vit_hub.layout import ModelDir
from vit_hub.model.config import CONV_STEMS, ViTConfig
from vit_hub.model.positions import sincos_positions

PATCH_WEIGHT = "patch_embedding.to_tokens.weight"
SHOWN_COMPONENTS = 28  # as many principal components as the paper's Figure 7 shows
LOCAL, GLOBAL = 0.5, 0.8  # a head is local below LOCAL x, global above GLOBAL x the uniform distance
BATCH = 16  # images per forward pass when measuring attention distances


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
    if config.patch_embedding in CONV_STEMS:
        return PatchFilters(None, None, "this model has a convolutional stem (3x3 convolutions with "
                            "BatchNorm and ReLU, then a 1x1 projection): no single linear filter per patch, "
                            "so the paper's filter view does not apply")
    if weights is None:
        return PatchFilters(None, None, f"the filters need the model's weights ({ModelDir.weights}), "
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
        raise UserError(f"expected the patch projection {PATCH_WEIGHT} of shape {list(expected)} "
                         f"in the weights, found {found}")
    return np.asarray(kernel, dtype=np.float64)


def shifted_window(kernel: np.ndarray, channels: int) -> np.ndarray:
    """Shifted patch tokenization's kernel [D, 5C, p_h, p_w] -> the same linear map on the
    original image [D, C, p_h + 2 dy, p_w + 2 dx] (dy, dx = half a patch).

    The model stacks the image with four copies moved half a patch towards each corner
    (`vit_hub.model.patches.PatchEmbedding`), so the token of a patch reads a window reaching half a patch
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
        raise UserError(f"expected learned positions pos_embedding of shape {list(expected)} in the weights, "
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


def _patch_keys(attentions: np.ndarray, config: ViTConfig) -> np.ndarray:
    """[..., T, T] -> [..., T, N]: each query's weights over the patch keys, summing to 1."""
    attentions = np.asarray(attentions, dtype=np.float64)
    tokens = config.num_tokens
    if attentions.ndim < 3 or attentions.shape[-2:] != (tokens, tokens):
        raise ValueError(f"expected attentions [..., {tokens}, {tokens}] (class token + {config.num_patches} "
                         f"patches), got shape {list(attentions.shape)}")
    keys = attentions[..., 1:]
    return keys / np.maximum(keys.sum(axis=-1, keepdims=True), 1e-12)


def _pooled_row(keys: np.ndarray, pooling: str) -> np.ndarray:
    """[..., T, N] -> [..., N]: the class token's row, or the mean of the patch tokens' rows."""
    return keys[..., 0, :] if pooling == "cls" else keys[..., 1:, :].mean(axis=-2)


def attention_distance(attentions: np.ndarray, config: ViTConfig) -> tuple[np.ndarray, np.ndarray]:
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


def mean_attention_distance(attend: Callable[[np.ndarray], np.ndarray], pixels: np.ndarray,
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
def head_maps(attentions: np.ndarray, config: ViTConfig) -> np.ndarray:
    """[depth, B, heads, T, T] -> [depth, B, heads, grid_h, grid_w]: each head's attention from
    the pooled token (the class token, or the mean of the patch tokens' rows) over the patches,
    every map scaled to [0, 1]."""
    rows = _pooled_row(_patch_keys(attentions, config), config.pooling)  # [L, B, H, N]
    return scale_maps(rows.reshape(*rows.shape[:-1], *config.grid_size))


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
        """One sentence per view, from its numbers, by view name (figures and files use the same names)."""
        return {"patch_filters": read_filters(self.filters),
                "position_similarity": read_positions(self.similarity, self.config, self.position_note),
                "attention_distance": read_distances(self.distance, self.pooled_distance, self.config,
                                                     self.data_note)}


def compute_views(config: ViTConfig, weights: dict[str, np.ndarray] | None,
                  attend: Callable[[np.ndarray], np.ndarray] | None = None, pixels: np.ndarray | None = None,
                  data_note: str = "") -> ModelViews:
    """Views 1-3. weights: None when only an ONNX graph is at hand (filters and learned positions
    then say so). attend and pixels: how to get attentions and of which images (None: no data)."""
    positions = position_table(weights, config)
    if config.pos_embedding == "sincos":
        position_note = "fixed sin-cos positions, computed rather than learned"
    elif positions is None:
        position_note = (f"learned positions need the model's weights ({ModelDir.weights}), "
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
NOT_SHOWN = ("Not shown:", "Not measured:")  # how the reading of a view that has no numbers starts


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
    layers = (f"Layer 1's heads attend {_span(first)} away" if depth == 1 else
              f"Layer 1's heads attend {_span(first)} away, layer {depth}'s {_span(last)}")
    token = pooled_token(config).split(" (")[0]
    spread = (f"{pooled[0].mean():.1f} px" if depth == 1 else
              f"{pooled[0].mean():.1f} px in layer 1 and {pooled[-1].mean():.1f} px in layer {depth}")
    return (f"{layers} (uniform attention: {uniform:.1f} px): {_locality_words(distance, uniform)}. "
            f"The attention of the {token} spreads over {spread} (mean of the heads).")


def _span(values: np.ndarray) -> str:
    """"12.4 to 13.6 px", or "14.7 px" when every value rounds alike."""
    low, high = f"{values.min():.1f}", f"{values.max():.1f}"
    return f"{low} px" if low == high else f"{low} to {high} px"


def _locality_words(distance: np.ndarray, uniform: float) -> str:
    """How local the early layers (the first half) and the last layer look, in words."""
    early, last = distance[: max(1, len(distance) // 2)].ravel(), distance[-1]
    local, wide = early < LOCAL * uniform, early > GLOBAL * uniform
    last_global = bool((last > GLOBAL * uniform).all())
    if wide.all():
        return "every head is global, from the first layers to the last" if last_global else \
            "the early layers are global, the last keeps local heads"
    early_words = ("the early layers mix local and global heads" if local.any() and wide.any() else
                   "the early layers are local" if local.all() else "the early layers look at middle distances")
    return f"{early_words}; {'the last layer is global' if last_global else 'the last layer keeps local heads'}"


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


