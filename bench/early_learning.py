"""How fast does the `mnist` preset leave the plateau where a ViT first sits on MNIST?

    OMP_NUM_THREADS=1 python bench/early_learning.py conv conv-augmented shifted

Each variant trains the 0.3 M-parameter mnist-preset ViT for 250 steps of batch 128
(AdamW 1e-3 with weight decay 0.05, 30 warmup steps, label smoothing 0.1, gradient
clipping 1.0, seed 0) and reports accuracy on the
first 1000 validation images. Variants:
  conv            plain ViT patch embedding, no augmentation
  conv-augmented  plain patches + the trainer's digit augmentation (random affine)
  shifted         shifted patch tokenization (Lee et al. 2021), no augmentation
Pass several names to run them one after another, or start one process per name.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from vit_hub.data import sources as vdata
from vit_hub.data.augmentation import TrainTransform
from vit_hub.data.batches import EvalTransform, Transformed, make_loader
from vit_hub.model.config import ViTConfig
from vit_hub.model.vit import VisionTransformer
from vit_hub.train.step import parameter_groups

VARIANTS = {
    "conv": dict(augment="none", patch_embedding="conv"),
    "conv-augmented": dict(augment="digits", patch_embedding="conv"),
    "shifted": dict(augment="none", patch_embedding="shifted"),
}


def run(name: str, splits: vdata.DataSplits, steps: int = 250, lr: float = 1e-3) -> float:
    variant = VARIANTS[name]
    torch.manual_seed(0)
    config = ViTConfig.from_preset("mnist", patch_embedding=variant["patch_embedding"])
    loader = make_loader(Transformed(splits.train, TrainTransform(config, variant["augment"])),
                               128, shuffle=True, seed=0, num_workers=1, pin_memory=False)
    model = VisionTransformer(config)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.05), lr=lr)
    for step, (images, labels) in enumerate(loader):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 30)
        loss = F.cross_entropy(model(images).logits, labels, label_smoothing=0.1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step + 1 == steps:
            break
    transform = EvalTransform(config)
    images = torch.stack([transform(splits.val[i][0]) for i in range(1000)])
    labels = torch.tensor([splits.val[i][1] for i in range(1000)])
    with torch.no_grad():
        return float((model.eval()(images).argmax(1) == labels).float().mean())


def main() -> None:
    names = sys.argv[1:] or list(VARIANTS)
    splits = vdata.load_splits("mnist")
    for name in names:
        started = time.perf_counter()
        accuracy = run(name, splits)
        print(f"| {name} | {accuracy:.3f} | {time.perf_counter() - started:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
