"""Drawing what `vit_hub.insight.views` measured: one matplotlib figure per view, and the per-head
attention maps as one image. No analysis happens here, and no file is read.

Figures are plain `matplotlib.figure.Figure`s, never pyplot's: a library that draws must
leave pyplot's global state and backend to its caller (a notebook keeps its own).
"""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from PIL import Image

from vit_hub.explain.rollout import colour_table
from vit_hub.insight.views import ModelViews, PatchFilters, pooled_token, uniform_distance
from vit_hub.model.config import ViTConfig


def draw_views(views: ModelViews) -> dict[str, Figure]:
    """Views 1-3 as figures, by view name (the names of `ModelViews.readings`)."""
    return {"patch_filters": plot_patch_filters(views.filters, views.config),
            "position_similarity": plot_position_similarity(views.similarity, views.config, views.position_note),
            "attention_distance": plot_attention_distance(views.distance, views.pooled_distance, views.config,
                                                          views.data_note)}


def view_images(views: ModelViews) -> dict[str, Image.Image]:
    """The figures as PIL images, by view name (for the app)."""
    return {name: figure_image(figure) for name, figure in draw_views(views).items()}


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
    figure = Figure(figsize=(6, 1.8))
    axis = figure.subplots()
    axis.set_axis_off()
    axis.text(0.5, 0.5, f"{title}: not shown\n\n" + textwrap.fill(note, 80), ha="center", va="center", fontsize=8)
    return figure


def _diverging():
    """Blue-white-red for signed filter weights."""
    return colormaps["RdBu_r"].with_extremes(bad="white")  # NaN gaps drawn white


def save_figure(figure: Figure, path: Path | io.BytesIO) -> None:
    """A figure as PNG, at the resolution every figure of this module is drawn for."""
    figure.savefig(path, dpi=110)


def figure_image(figure: Figure) -> Image.Image:
    """A figure as an RGB PIL image (what the app shows)."""
    buffer = io.BytesIO()
    save_figure(figure, buffer)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB")


# Per-head attention maps -------------------------------------------------------------------
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
