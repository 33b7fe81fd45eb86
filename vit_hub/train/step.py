"""One optimizer step of training, and how it is set up for its device: AdamW with weight decay
on matrices only, autocast precision, torch.compile where it pays, and the update itself
(label-smoothed cross-entropy, backward, gradient clipping, loss scaling for float16).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vit_hub.train.distributed import Runtime, across_processes

MIN_COMPILE_STEPS = 5000  # --compile's default: from this many optimizer steps on (CUDA)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: not on biases, norms, positions or the class token."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        skip = parameter.ndim <= 1 or name.endswith(("pos_embedding", "cls_token"))
        (no_decay if skip else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, weight_decay: float, lr: float) -> torch.optim.Optimizer:
    """AdamW over `parameter_groups`. Fused: one kernel updates every parameter, on the CPU as
    on CUDA, instead of a loop of small ones per tensor."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=(0.9, 0.999), fused=True)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPUs that have it, fp16 (with a grad scaler) on older ones, full fp32 on
    the CPU (None: bf16 matmuls are far slower than fp32 on CPUs without bf16 units)."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def choose_compile(requested: bool | None, device_type: str, total_steps: int, triton: bool,
                   capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether to torch.compile the training step, and why (said in the log). --compile and
    --no-compile decide; by default it is on for CUDA runs of at least MIN_COMPILE_STEPS
    steps, where a faster step repays the compile time (about a minute for ViT-S/16;
    BENCHMARKS.md, "One training step against timm, GPU"), and off on the CPU."""
    if requested is not None:
        return requested, "--compile" if requested else "--no-compile"
    if device_type != "cuda":
        return False, "the default on the CPU; --compile to try it"
    if not triton:
        return False, "torch.compile needs Triton on CUDA, which is not installed"
    if capability is not None and capability < (7, 0):
        return False, f"Triton needs a GPU of compute capability 7.0 or newer, this one is {capability[0]}.{capability[1]}"
    if total_steps < MIN_COMPILE_STEPS:
        return False, (f"{total_steps} steps are too few to repay the compile time (the default compiles from "
                       f"{MIN_COMPILE_STEPS}); --compile to force it")
    return True, f"the default for {total_steps} steps on CUDA; --no-compile to turn it off"


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclasses.dataclass
class TrainStep:
    """The update of one batch. `network` is what runs the batch (the model, compiled and
    wrapped for DDP as chosen); `model` is the bare model whose gradients are clipped."""

    model: nn.Module
    network: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    label_smoothing: float
    grad_clip: float
    compiled: bool = False
    compile_reason: str = ""

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on a batch; returns its logits [B, classes] and mean loss."""
        device_type = images.device.type
        autocast = (torch.autocast(device_type, dtype=self.amp_dtype) if self.amp_dtype
                    else contextlib.nullcontext())
        with autocast:
            logits = self.network(images).logits
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return logits, loss


def build_step(model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime, compile: bool | None,
               total_steps: int, label_smoothing: float, grad_clip: float) -> TrainStep:
    """The step for this device and these processes: compiled if `compile` (or its default)
    says so, then wrapped for DDP."""
    device = runtime.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    compiled, reason = choose_compile(compile, device.type, total_steps, triton=has_triton(), capability=capability)
    network = torch.compile(model) if compiled else model
    amp_dtype = autocast_dtype(device)
    # Loss scaling keeps float16 gradients from underflowing; bf16 and fp32 need none.
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    return TrainStep(model, across_processes(network, runtime), optimizer, scaler, amp_dtype,
                     label_smoothing, grad_clip, compiled, reason)
