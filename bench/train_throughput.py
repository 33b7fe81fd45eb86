"""Training-step throughput of vit_hub's VisionTransformer against timm's, at identical configs.

    python bench/train_throughput.py [--threads 1] [--rounds 15] [--steps 3] [--configs mnist cifar]
                                     [--profile] [--compile]
    python bench/train_throughput.py --device cuda --amp bf16 --configs vit-s16   # on a GPU

One training step = forward, label-smoothed cross entropy, backward, gradient clipping and an
AdamW step (what `vit_hub.train.step.TrainStep` does), on synthetic tensors (no data loading). Both models
are timed in the same process, in alternating rounds of `--steps` steps (the order flips every
round), so machine noise hits both alike; medians and ratios are reported.

Two clocks: wall time, and the process's CPU time divided by the thread count. On a machine
shared with other jobs the wall clock also counts the time this process waited for a core;
with one thread CPU time does not, so it is the steadier measure there (with more threads it
also counts threads spinning while they wait for each other).

timm is configured to match: qkv bias, MLP ratio, LayerNorm eps 1e-6, a class token with
positions on the patch tokens only (`no_embed_class=True`, as ours), class-token pooling,
all dropout rates 0; parameter counts are checked equal. Achieved GFLOP/s uses
`torch.utils.flop_counter` on one step (forward + backward, counted with SDPA's math backend
so that the attention matmuls are seen), against this machine's fp32 matmul peak
measured with `torch.mm` at the same thread count. On a GPU the CPU-time column means
nothing (read the wall clock), and the step is also held against the GPU's datasheet peak in
the step's dtype (`vit_hub.model.flops.peak_flops`): that is the MFU the training log prints,
one definition for both; the share of the matmul peak measured here stays beside it.
`--json PATH` also writes every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vit_hub.model.config import PRESETS  # noqa: E402
from vit_hub.model.flops import peak_flops  # noqa: E402
from vit_hub.model.vit import VisionTransformer  # noqa: E402

# The mnist preset with ViT's plain conv patch embedding and learned positions: timm has no
# shifted patch tokenization. The preset as shipped (shifted patches, fixed sin-cos
# positions) is timed too, as a third model, to show what it costs.
CONFIGS = {
    "mnist": dict(PRESETS["mnist"], patch_embedding="conv", pos_embedding="learned", batch_size=128),
    "cifar": dict(image_size=32, patch_size=4, in_channels=3, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0,
                  labels=[str(i) for i in range(10)], batch_size=128),
    # ViT-S/16 at ImageNet size and classes: the GPU comparison.
    "vit-s16": dict(image_size=224, patch_size=16, in_channels=3, embed_dim=384, depth=12, num_heads=6,
                    mlp_ratio=4.0, labels=[str(i) for i in range(1000)], batch_size=256),
}
SHIFTED = "vit_hub, mnist preset as shipped"


def models_for(name: str) -> tuple[str, ...]:
    shipped_shifted = name == "mnist" and PRESETS["mnist"].get("patch_embedding") == "shifted"
    return ("vit_hub", "timm", SHIFTED) if shipped_shifted else ("vit_hub", "timm")


def build(name: str, config: dict) -> torch.nn.Module:
    ours = {k: v for k, v in config.items() if k != "batch_size"}
    if name == "vit_hub":
        return VisionTransformer(**ours)
    if name == SHIFTED:
        return VisionTransformer(**{**ours, "patch_embedding": "shifted", "pos_embedding": PRESETS["mnist"]["pos_embedding"]})
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    return TimmViT(
        img_size=config["image_size"], patch_size=config["patch_size"], in_chans=config["in_channels"],
        num_classes=len(config["labels"]), global_pool="token", embed_dim=config["embed_dim"],
        depth=config["depth"], num_heads=config["num_heads"], mlp_ratio=config["mlp_ratio"], qkv_bias=True,
        class_token=True, no_embed_class=True, drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0,
        attn_drop_rate=0.0, drop_path_rate=0.0,  # norm_layer defaults to LayerNorm(eps=1e-6)
    )


class Stepper:
    """One model, its AdamW and a fixed synthetic batch; `step()` is one training step."""

    def __init__(self, model: torch.nn.Module, config: dict, device: torch.device, compile: bool = False,
                 amp: torch.dtype | None = None):
        self.model = model.to(device).train()
        self.amp = amp
        self.network = torch.compile(self.model) if compile else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.05)
        generator = torch.Generator().manual_seed(0)
        side = config["image_size"]
        self.images = torch.randn(config["batch_size"], config["in_channels"], side, side,
                                  generator=generator).to(device)
        self.labels = torch.randint(0, len(config["labels"]), (config["batch_size"],), generator=generator).to(device)
        self.device = device

    def step(self, eager: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        network = self.model if eager else self.network
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
            output = network(self.images)
            logits = getattr(output, "logits", output)  # vit_hub returns ViTOutput, timm a tensor
        loss = F.cross_entropy(logits.float(), self.labels, label_smoothing=0.1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def time_steps(self, steps: int) -> tuple[float, float]:
        """(wall seconds, CPU seconds) per step over `steps` consecutive steps."""
        self._sync()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        self._sync()
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

    def flops_per_step(self) -> int:
        counter = FlopCounterMode(display=False)
        # The same arithmetic, compiled or not; SDPA's math backend so that the counter sees
        # the attention matmuls (it cannot look inside the fused CPU kernel).
        with counter, sdpa_kernel(SDPBackend.MATH):
            self.step(eager=True)
        return counter.get_total_flops()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, repeats: int = 10) -> tuple[float, float]:
    """Best GFLOP/s of an n x n x n torch.mm: (by wall time, by CPU time / threads)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, (time.process_time() - cpu) / torch.get_num_threads())
    flops = 2 * n**3
    return flops / best_wall / 1e9, flops / max(best_cpu, 1e-9) / 1e9


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def profile(stepper: Stepper, name: str, rows: int = 15) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    stepper.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if stepper.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            stepper.step()
    sort = "self_cuda_time_total" if stepper.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n### profile: {name} (3 steps, top {rows} ops by self time)\n")
    print(prof.key_averages().table(sort_by=sort, row_limit=rows))


def measure(name: str, config: dict, args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    models = models_for(name)
    amp = {"none": None, "bf16": torch.bfloat16}[args.amp]
    steppers = {model: Stepper(build(model, config), config, device, args.compile, amp) for model in models}
    counts = {model: sum(p.numel() for p in stepper.model.parameters()) for model, stepper in steppers.items()}
    if counts["vit_hub"] != counts["timm"]:
        raise SystemExit(f"{name}: parameter counts differ: {counts}")
    flops = {model: stepper.flops_per_step() for model, stepper in steppers.items()}
    for stepper in steppers.values():  # warm-up: allocator, kernels, AdamW state
        stepper.time_steps(args.warmup)
    wall: dict[str, list[float]] = {model: [] for model in models}
    cpu: dict[str, list[float]] = {model: [] for model in models}
    load_before = load()
    for round_index in range(args.rounds):
        for model in (models if round_index % 2 == 0 else models[::-1]):
            wall_seconds, cpu_seconds = steppers[model].time_steps(args.steps)
            wall[model].append(wall_seconds)
            cpu[model].append(cpu_seconds / torch.get_num_threads())
    batch = config["batch_size"]
    result = {"name": name, "parameters": counts["vit_hub"], "load": f"{load_before} -> {load()}", "rows": {}}
    for model in models:  # per-round ratios against timm: rounds are adjacent in time
        for clock, seconds in (("wall", wall), ("cpu", cpu)):
            result.setdefault(f"{clock}_round_ratios", {})[model] = [
                t / o for o, t in zip(seconds[model], seconds["timm"])]
    for model in models:
        rates = [batch / s for s in wall[model]]
        result["rows"][model] = {
            "wall": statistics.median(rates), "wall_min": min(rates), "wall_max": max(rates),
            "cpu": batch / statistics.median(cpu[model]),
            "gflop_step": flops[model] / 1e9,
            # while holding its cores (CPU) or the GPU's wall clock
            "gflop_s": flops[model] / statistics.median((wall if device.type == "cuda" else cpu)[model]) / 1e9,
        }
    if args.profile:
        for model, stepper in steppers.items():
            profile(stepper, f"{name} / {model}")
    return result


def describe(config: dict) -> str:
    side = config["image_size"]
    return (f"{side}x{side}x{config['in_channels']}, patch {config['patch_size']}, dim {config['embed_dim']}, "
            f"depth {config['depth']}, heads {config['num_heads']}, batch {config['batch_size']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["mnist", "cifar"], choices=list(CONFIGS),
                        help="default: the two CPU configs (vit-s16 is for a GPU)")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per model")
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", choices=["none", "bf16"], default="none", help="autocast the forward pass")
    parser.add_argument("--batch-size", type=int, help="override the configs' batch size")
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table per model")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models (the optimizer stays eager)")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.batch_size:
        for config in CONFIGS.values():
            config["batch_size"] = args.batch_size
    import timm

    peak_dtype = torch.bfloat16 if args.amp == "bf16" else torch.float32
    peaks = [matmul_peak(device, peak_dtype)]
    results = [measure(name, CONFIGS[name], args, device) for name in args.configs]
    peaks.append(matmul_peak(device, peak_dtype))  # before and after: a single measurement can be unlucky
    peak_wall, peak_cpu = max(p[0] for p in peaks), max(p[1] for p in peaks)

    print(f"command: python bench/train_throughput.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, timm {timm.__version__}, device {device}, "
          f"{torch.get_num_threads()} thread(s), {os.cpu_count()} cores, {'compiled' if args.compile else 'eager'}, "
          f"autocast {args.amp}" + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    print(f"{str(peak_dtype).removeprefix('torch.')} matmul peak (torch.mm, best of 20): {peak_wall:.1f} GFLOP/s by wall time, "
          f"{peak_cpu:.1f} GFLOP/s by CPU time / threads\n")
    datasheet = peak_flops(torch.cuda.get_device_name(device), peak_dtype) if device.type == "cuda" else None
    if datasheet:
        print(f"datasheet peak (vit_hub.model.flops, what the training log's MFU divides by): {datasheet / 1e12:.0f} TFLOP/s\n")
    print("| config | model | img/s wall (min-max) | img/s CPU time | vs timm, wall | vs timm, CPU time "
          "| GFLOP/step | GFLOP/s (CPU time; GPU: wall) | of measured matmul peak | MFU (datasheet peak) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        for model, row in result["rows"].items():
            wall_ratio = statistics.median(result["wall_round_ratios"][model])
            cpu_ratio = statistics.median(result["cpu_round_ratios"][model])
            row["mfu"] = row["gflop_s"] * 1e9 / datasheet if datasheet else None
            mfu = f"{row['mfu']:.1%}" if datasheet else "-"
            print(f"| {result['name']} | {model} | {row['wall']:.0f} ({row['wall_min']:.0f}-{row['wall_max']:.0f}) | "
                  f"{row['cpu']:.0f} | {wall_ratio:.3f}x | {cpu_ratio:.3f}x | {row['gflop_step']:.1f} | "
                  f"{row['gflop_s']:.1f} | {row['gflop_s'] / (peak_wall if device.type == 'cuda' else peak_cpu):.0%} "
                  f"| {mfu} |")
    print()
    if args.json:
        args.json.write_text(json.dumps({result["name"]: result["rows"] for result in results}, indent=2))
    for result in results:
        cpu_ratios, wall_ratios = result["cpu_round_ratios"]["vit_hub"], result["wall_round_ratios"]["vit_hub"]
        print(f"- {result['name']} ({describe(CONFIGS[result['name']])}): {result['parameters']:,} parameters each; "
              f"vit_hub/timm per-round ratio, CPU time: median {statistics.median(cpu_ratios):.3f} "
              f"(range {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}); wall: median {statistics.median(wall_ratios):.3f} "
              f"(range {min(wall_ratios):.3f}-{max(wall_ratios):.3f}); load average 1/5 min {result['load']}")


if __name__ == "__main__":
    main()
