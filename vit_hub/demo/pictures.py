"""The answer drawn: the chosen method's map over the image, rollout after each layer, the
model's input and each head's attention. Overlays have the input's size, except: a longer side
under DISPLAY_MIN_SIDE is scaled up by the smallest integer factor reaching it (28x28 ->
280x280), one over DISPLAY_MAX_SIDE is scaled down to it. Drawings are shown as the model sees
them (the centred digit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vit_hub.demo.backends import Predictor
from vit_hub.explain.attribution import METHODS, check_method
from vit_hub.explain.rollout import layer_rollouts, overlay
from vit_hub.insight.figures import head_grid
from vit_hub.insight.views import head_maps
from vit_hub.model.config import ViTConfig
from vit_hub.processing.postprocess import top_k
from vit_hub.processing.preprocess import model_pixels, resize

DISPLAY_MIN_SIDE = 280
DISPLAY_MAX_SIDE = 1024
STRIP_TILE_HEIGHT = 96  # height of each tile in the per-layer rollout strip
STRIP_GAP = 4  # white pixels between two tiles of the strip
MAP_DECIMALS = 4  # of the map's values in /predict's answer


@dataclass
class Explanation:
    scores: dict[str, float]  # top-k label -> probability
    overlay: Image.Image  # the chosen method's map over the display image
    strip: Image.Image  # rollout after each layer, left to right
    model_input: Image.Image  # the input as the model saw it (canonicalised, resized), enlarged
    heads: Image.Image  # each head's attention from the pooled token: a row per layer, a column per head


def display_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) an overlay is drawn at for an input of that size."""
    longer = max(width, height)
    if longer < DISPLAY_MIN_SIDE:
        factor = math.ceil(DISPLAY_MIN_SIDE / longer)
        return width * factor, height * factor
    if longer > DISPLAY_MAX_SIDE:
        scale = DISPLAY_MAX_SIDE / longer
        return max(1, round(width * scale)), max(1, round(height * scale))
    return width, height


def for_display(image: Image.Image) -> Image.Image:
    """The image at its display size; small images keep sharp pixels."""
    size = display_size(*image.size)
    if size == image.size:
        return image
    upscaling = size[0] > image.width
    return image.resize(size, Image.Resampling.NEAREST if upscaling else Image.Resampling.BILINEAR)


def layer_strip(view: Image.Image, maps: np.ndarray) -> Image.Image:
    """One tile per layer: maps [depth, grid_h, grid_w] over the model's view, side by side."""
    width = max(1, round(view.width * STRIP_TILE_HEIGHT / view.height))
    tile_base = view.resize((width, STRIP_TILE_HEIGHT), Image.Resampling.NEAREST)
    strip = Image.new("RGB", (len(maps) * (width + STRIP_GAP) - STRIP_GAP, STRIP_TILE_HEIGHT), "white")
    for index, layer_map in enumerate(maps):
        strip.paste(overlay(tile_base, layer_map), (index * (width + STRIP_GAP), 0))
    return strip


@dataclass
class Answer:
    scores: dict[str, float]  # top-k label -> probability
    attentions: np.ndarray  # [depth, 1, heads, tokens, tokens]
    rollouts: np.ndarray  # rollout after each layer [depth, grid_h, grid_w]
    method_map: np.ndarray  # the chosen method's map [grid_h, grid_w]


def answer(predictor: Predictor, view: Image.Image, head_fusion: str, discard_ratio: float, k: int,
           method: str) -> Answer:
    """Classify `view` (already in the model's domain: `to_model_domain`) and compute the
    method's map. Rollout uses head_fusion and discard_ratio, so its map is the last layer's
    rollout; any other method's map comes from the backend."""
    config = predictor.config
    pixels = model_pixels(view, config)[None]  # [1, C, H, W]
    if check_method(method) is METHODS["rollout"]:
        probabilities, attentions = predictor.predict(pixels)
        chosen = None
    else:
        probabilities, attentions, chosen = predictor.explain(pixels, method)
    rollouts = layer_rollouts(attentions, head_fusion, discard_ratio, config.grid_size, config.pooling)[:, 0]
    scores = dict(top_k(probabilities, config.labels, k)[0])
    return Answer(scores, attentions, rollouts, rollouts[-1] if chosen is None else chosen[0])


def map_values(method: str, method_map: np.ndarray, config: ViTConfig) -> dict:
    """The map as /predict returns it: numbers, not a picture (nothing for a client to download).
    map[i][j] scores the patch in row i, column j of the image the model saw (its input after
    canonicalisation and resizing: `patch_size` pixels each)."""
    return {"method": method, "grid": list(config.grid_size), "patch_size": list(config.patch_size),
            "map": np.round(method_map.astype(np.float64), MAP_DECIMALS).tolist()}


def explain(predictor: Predictor, view: Image.Image, head_fusion: str, discard_ratio: float,
            k: int, method: str = "rollout") -> Explanation:
    """Classify `view` (already in the model's domain) and draw what the page shows: the
    method's map over the view at its display size, rollout after each layer (always
    rollout), the model's input and each head's attention."""
    config = predictor.config
    result = answer(predictor, view, head_fusion, discard_ratio, k, method)
    model_view = resize(view, config)
    heads = head_grid(model_view, head_maps(result.attentions, config)[:, 0])  # [depth, heads, h, w] maps
    return Explanation(result.scores, overlay(for_display(view), result.method_map),
                       layer_strip(model_view, result.rollouts), for_display(model_view), heads)
