"""A convolutional teacher trained beside the ViT, and the distillation loss that passes what it
learns to the ViT (`vit-hub train --teacher resnet18`).

DeiT (Touvron et al. 2021) trains a ViT on the labels and, with equal weight, on the classes a
convolutional teacher predicts for the same augmented images ("hard distillation"): the teacher's
locality reaches the ViT through its targets. Here the teacher is a torchvision ResNet-18 trained
from scratch on the same folder, in the same loop: each step it trains on the batch the ViT trains
on, and its predictions for that batch (from that same forward pass, before its update) are the
ViT's second targets. One pass over the data trains both, so a run costs one more network's
step, not a second run. DeiT's separate distillation token is not built: the targets go to the
ViT's one head (DeiT's "hard distillation" row), so the model, its export and its explanations
are those of any vit_hub model. The teacher is not saved; its accuracy is reported in
metrics.json (`teacher`). The training loss a run logs is the ViT's, as below.

    batch -> teacher step (labels, label smoothing) -> teacher's classes [B]
          -> ViT: (CE(logits, labels, smoothed) + CE(logits, teacher's classes)) / 2
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from vit_hub.model.config import ViTConfig
from vit_hub.model.vit import ViTOutput
from vit_hub.train.distributed import Runtime
from vit_hub.train.evaluation import evaluate
from vit_hub.train.settings import TrainingError

# The teacher's peak AdamW learning rate and weight decay, whatever the ViT's (those of the
# ResNet-18 reference in BENCHMARKS.md, "Real photos over three seeds"); it follows the ViT's
# warmup and cosine decay.
TEACHER_LR, TEACHER_WEIGHT_DECAY = 1e-3, 0.05


class TeacherNet(nn.Module):
    """A torchvision ResNet-18 from scratch for the config's classes and channels, returning
    `ViTOutput` as the ViT does (so `evaluation.evaluate` scores it)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(weights=None, num_classes=config.num_classes)
        if config.in_channels != 3:  # grayscale: the first convolution takes one channel
            self.net.conv1 = nn.Conv2d(config.in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)

    def forward(self, images: torch.Tensor) -> ViTOutput:
        return ViTOutput(self.net(images))  # logits [B, classes]


class Teacher:
    """The teacher network (`name`, one of TEACHERS), its optimizer and its update; `lr_scale`
    turns the ViT's learning rate at a step into the teacher's (TEACHER_LR at the ViT's peak)."""

    def __init__(self, config: ViTConfig, device: torch.device, seed: int, student_peak_lr: float,
                 name: str = "resnet18"):
        self.name = name
        torch.manual_seed(seed)
        self.network = TeacherNet(config).to(device)
        self.optimizer = torch.optim.AdamW(self.network.parameters(), lr=TEACHER_LR,
                                           weight_decay=TEACHER_WEIGHT_DECAY)
        self.lr_scale = TEACHER_LR / student_peak_lr

    def set_lr(self, student_lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = student_lr * self.lr_scale

    def update(self, images: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
               amp_dtype: torch.dtype | None) -> torch.Tensor:
        """One optimizer step of the teacher on the batch; returns the classes [B] it predicted
        for it in that step's forward pass."""
        self.network.train()
        # bf16 autocast as the ViT's step; float16 would need loss scaling, so there it runs in float32
        autocast = (torch.autocast(images.device.type, dtype=amp_dtype) if amp_dtype == torch.bfloat16
                    else contextlib.nullcontext())
        with autocast:
            logits = self.network(images).logits.float()
        loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return logits.detach().argmax(1)


    def describe(self) -> str:
        """The training log's line about the teacher."""
        return (f"teacher: {self.name}, trained beside the model on the same batches (its predicted classes "
                f"are the model's second targets)")

    def scores(self, loaders, runtime: Runtime, num_classes: int) -> dict[str, float | str]:
        """The teacher's accuracy at the last epoch on each evaluation split of `loaders` (a
        `loaders.RunLoaders`), printed, and returned for metrics.json."""
        scores = {name: evaluate(self.network, loaders.eval_loader(name), runtime.device, num_classes,
                                 runtime)["accuracy"] for name in loaders.eval_sets}
        if runtime.is_main:
            print(f"teacher ({self.name}, last epoch): " +
                  ", ".join(f"{name} accuracy {accuracy:.3f}" for name, accuracy in scores.items()))
        return {"network": self.name, **scores}


def distillation_loss(logits: torch.Tensor, labels: torch.Tensor, taught: torch.Tensor,
                      label_smoothing: float) -> torch.Tensor:
    """DeiT's hard distillation: half the loss on the labels (smoothed), half on the teacher's
    classes `taught` [B]."""
    return 0.5 * (F.cross_entropy(logits, labels, label_smoothing=label_smoothing) + F.cross_entropy(logits, taught))


def check_teacher(teacher: str | None, processes: int, resume: bool, pausing: bool) -> None:
    """A teacher trains in one process, from the start to the last epoch: it is not in the
    checkpoint, so a run with one is neither paused nor resumed."""
    if teacher is None:
        return
    if processes > 1:
        raise TrainingError(f"--teacher {teacher}: expected one process, found {processes} (torchrun); "
                            f"train with a teacher in one process")
    if resume or pausing:
        flag = "--resume" if resume else "--stop-after-epochs"
        raise TrainingError(f"--teacher {teacher}: expected a run from the start to its last epoch, got {flag} "
                            f"(the teacher is not kept in the checkpoint); start the run again without it")
