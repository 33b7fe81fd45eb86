"""Is the rollout map faithful? Mask the patches it ranks highest and watch the true class.

For each of N MNIST test images: compute the rollout, set the top 30 % of patches (by
rollout value) to the background value, and measure how much the true-class
probability drops. Compare with masking a random 30 % of patches (averaged over several
draws per image). Faithful maps give a much larger drop: the target is a ratio >= 2.

The mask value is the background: pixel 0 (black), i.e. (0 - mean) / std after
normalisation, so a masked patch looks like empty paper rather than a new grey shape.
As a harder baseline the script also masks a random 30 % of patches among those that
contain ink (random background patches are often no-ops on MNIST).

    python bench/faithfulness.py [--model models/vit-mnist] [--images 500] [--share 0.3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from vit_hub.data import load_splits
from vit_hub.pretrained import load_model
from vit_hub.preprocess import preprocess_batch
from vit_hub.rollout import attention_gradients, attention_rollout, gradient_rollout

SETTINGS = [("mean", 0.0), ("mean", 0.5), ("mean", 0.9), ("max", 0.0), ("max", 0.9), ("min", 0.0)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/vit-mnist")
    parser.add_argument("--images", type=int, default=500, help="first N images of the MNIST test split")
    parser.add_argument("--share", type=float, default=0.3, help="share of patches masked")
    parser.add_argument("--draws", type=int, default=10, help="random masks per image")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def test_images(count: int, config) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` bundled MNIST test images -> (pixels [N, C, H, W], labels [N])."""
    test = load_splits("mnist", val_split=0.0).test
    pairs = [test[i] for i in range(count)]
    return preprocess_batch([image for image, _ in pairs], config), np.array([label for _, label in pairs])


def mask_patches(pixels: np.ndarray, chosen: np.ndarray, patch: tuple[int, int], value: np.ndarray) -> np.ndarray:
    """pixels [N, C, H, W]; chosen [N, grid_h, grid_w] bool -> copy with chosen patches set to value [C]."""
    per_pixel = chosen.repeat(patch[0], axis=1).repeat(patch[1], axis=2)[:, None]  # [N, 1, H, W]
    return np.where(per_pixel, value[None, :, None, None], pixels).astype(np.float32)


def top_patches(maps: np.ndarray, count: int) -> np.ndarray:
    """maps [N, h, w] -> bool [N, h, w], True on each map's `count` highest patches."""
    flat = maps.reshape(len(maps), -1)
    order = np.argsort(-flat, axis=1, kind="stable")[:, :count]
    chosen = np.zeros_like(flat, dtype=bool)
    np.put_along_axis(chosen, order, True, axis=1)
    return chosen.reshape(maps.shape)


def random_patches(allowed: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """bool [N, h, w] of `count` random patches per image among the allowed ones (all if too few)."""
    scores = rng.random(allowed.shape) + allowed  # allowed patches rank first, in random order
    return top_patches(scores, count)


@torch.no_grad()
def true_class_probability(model, pixels: np.ndarray, labels: np.ndarray, batch: int = 250) -> np.ndarray:
    probabilities = [model(torch.from_numpy(pixels[i:i + batch])).logits.softmax(-1).numpy()
                     for i in range(0, len(pixels), batch)]
    return np.concatenate(probabilities)[np.arange(len(labels)), labels]


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = load_model(args.model)
    config = model.config
    pixels, labels = test_images(args.images, config)
    grid, patch = config.grid_size, tuple(config.patch_size)
    count = round(args.share * grid[0] * grid[1])
    background = (0.0 - np.asarray(config.mean, np.float32)) / np.asarray(config.std, np.float32)

    with torch.no_grad():
        logits, attentions = model(torch.from_numpy(pixels), output_attentions=True)
    base = logits.softmax(-1).numpy()[np.arange(len(labels)), labels]
    accuracy = float((logits.argmax(-1).numpy() == labels).mean())

    def drop(chosen: np.ndarray) -> float:
        return float((base - true_class_probability(model, mask_patches(pixels, chosen, patch, background), labels)).mean())

    ink = pixels.reshape(len(pixels), config.in_channels, grid[0], patch[0], grid[1], patch[1])
    has_ink = (ink > background[None, :, None, None, None, None] + 1e-3).any(axis=(1, 3, 5))  # [N, h, w]
    random_drop = np.mean([drop(random_patches(np.ones_like(has_ink), count, rng)) for _ in range(args.draws)])
    ink_drop = np.mean([drop(random_patches(has_ink, count, rng)) for _ in range(args.draws)])

    rows = []
    for head_fusion, discard_ratio in SETTINGS:
        maps = attention_rollout(attentions, head_fusion, discard_ratio, grid, config.pooling)
        rows.append((f"rollout {head_fusion}, discard {discard_ratio}", drop(top_patches(maps, count))))
    _, grad_attentions, gradients = attention_gradients(model, torch.from_numpy(pixels), torch.from_numpy(labels))
    rows.append(("gradient rollout (true class)", drop(top_patches(gradient_rollout(grad_attentions, gradients, grid, config.pooling), count))))

    print(f"model {args.model}: accuracy {accuracy:.4f} on the first {args.images} MNIST test images; "
          f"masking {count} of {grid[0] * grid[1]} patches ({args.share:.0%}) with the background value "
          f"{', '.join(f'{v:.4f}' for v in background)} (pixel 0)")
    print(f"mean true-class probability {base.mean():.4f}; random {args.share:.0%} drop {random_drop:.4f}, "
          f"random {args.share:.0%} of ink patches drop {ink_drop:.4f} ({args.draws} draws each); the largest "
          f"possible drop (to 0) would be a ratio of {base.mean() / random_drop:.2f}x vs random")
    print("| map | mean drop | ratio vs random | ratio vs random ink patches |\n|---|---|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.4f} | {value / random_drop:.2f}x | {value / ink_drop:.2f}x |")
    print(f"\nload average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}; "
          f"command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
