"""Fine-tuning from pretrained weights against training from scratch, same budget.

    OMP_NUM_THREADS=1 python bench/fine_tune.py --work /tmp/fine_tune --target parity [--seeds 0,1,2] [--epochs 50]

1. pretrain: a plain ViT (conv patches, learned positions, class token: the layout of timm's
   VisionTransformer) on the bundled MNIST with `vit-hub train` (skipped when --work has it);
2. publish it as timm publishes its ViTs: the weights loaded into timm's VisionTransformer
   (logits checked against vit_hub's), saved with `timm.models.save_for_hf` (config.json +
   model.safetensors), and read back with `vit-hub import` (logits checked again);
3. on a small, different task train, for each seed and with the same budget (epochs; batch
   and schedule from the same defaults):
     parity   even vs odd digits, 60 + 60 training images drawn from MNIST's *test* split
              (pretraining never saw them, nor this labelling), 500 + 500 test images;
     shapes   circles vs squares (shapes_tiny of bench/shifted_sets.py, 120 training images),
              a task the digit features were not learned for;
     init     `vit-hub train --init <the timm folder>` (fine-tuning defaults),
     init-lr5e-4  the same at the from-scratch learning rate,
     init-llrd    the same with layer-wise learning-rate decay 0.75 (the BEiT / MAE fine-tuning
              recipe; vit_hub has no such option: this bench patches it in, to measure it),
     scratch  the same architecture from scratch (vit_hub's from-scratch lr),
     default  vit_hub's own choice for the data from scratch (small-data preset).
Prints a Markdown table of test accuracy and writes results_<target>.json under --work. Needs timm
(requirements-dev.txt); vit_hub itself never imports it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shifted_sets import make_shapes_tiny  # noqa: E402
from vit_hub.hub.import_model import import_model  # noqa: E402
from vit_hub.hub.pretrained import load_model  # noqa: E402

# The pretrained architecture: a plain ViT timm can hold (no shifted patches, no conv stem, no
# locality attention, dataset mean/std rather than per-image normalisation).
ARCHITECTURE = ["--image-size", "28", "--patch-size", "4", "--in-channels", "1", "--embed-dim", "64", "--depth", "4",
                "--num-heads", "4", "--mlp-ratio", "2", "--dropout", "0", "--drop-path", "0.1",
                "--patch-embedding", "conv", "--pos-embedding", "learned", "--pooling", "cls",
                "--no-locality-attention", "--pixel-norm", "dataset", "--canonicalize", "none"]


def vit_hub(*args: str, log: Path, layer_decay: float | None = None) -> dict:
    """Run `vit-hub ...` (with `layer_decay`: patched, see `run_with_layer_decay`), its output to
    `log`; the run's metrics.json when it trained."""
    command = [sys.executable, "-m", "vit_hub", *args]
    if layer_decay is not None:
        command = [sys.executable, __file__, "--layer-decay-run", str(layer_decay), *args]
    print("$ vit-hub " + " ".join(args), flush=True)
    with log.open("w") as output:
        subprocess.run(command, check=True, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "metrics.json").read_text())


def pretrain(work: Path, epochs: int) -> Path:
    out = work / "pretrained"
    if not (out / "metrics.json").is_file() or "final" not in json.loads((out / "metrics.json").read_text()):
        vit_hub("train", "--data", "mnist", *ARCHITECTURE, "--epochs", str(epochs), "--workers", "0", "--seed", "0",
                "--overwrite", "--out", str(out), log=work / "pretrain.log")
    return out


def to_timm(model):
    """A vit_hub model (plain layout) as timm's VisionTransformer with the same weights."""
    import timm

    config = model.config
    timm_model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=tuple(config.image_size), patch_size=tuple(config.patch_size),
        in_chans=config.in_channels, embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads,
        mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias, num_classes=config.num_classes,
        no_embed_class=not config.class_token_position)  # vit_hub: positions for the patches only
    names = {"attention_norm": "norm1", "attention.to_qkv": "attn.qkv", "attention.to_out.0": "attn.proj",
             "mlp_norm": "norm2", "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2"}
    state = {"cls_token": model.cls_token, "pos_embed": model.pos_embedding,
             "patch_embed.proj.weight": model.patch_embedding.to_tokens.weight,
             "patch_embed.proj.bias": model.patch_embedding.to_tokens.bias,
             "norm.weight": model.norm.weight, "norm.bias": model.norm.bias,
             "head.weight": model.head.weight, "head.bias": model.head.bias}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            layer, kind = rest.rsplit(".", 1)
            state[f"blocks.{index}.{names[layer]}.{kind}"] = tensor
    timm_model.load_state_dict({name: tensor.detach().clone() for name, tensor in state.items()}, strict=True)
    return timm_model.eval()


def publish_as_timm(pretrained: Path, work: Path) -> Path:
    """Save the pretrained model as timm does; check logits through timm and through vit-hub import."""
    import timm

    model = load_model(pretrained)
    config = model.config
    timm_model = to_timm(model)
    images = torch.randn(8, config.in_channels, *config.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(images).logits, timm_model(images)
    out = work / "timm_published"
    timm.models.save_for_hf(
        timm_model, out, safe_serialization=True,
        model_config={"label_names": config.labels, "pretrained_cfg": {"tag": "vit_hub_mnist", "license": "mit"}},
        data_config={"input_size": (config.in_channels, *config.image_size), "mean": tuple(config.mean),
                     "std": tuple(config.std), "interpolation": config.interpolation, "crop_pct": 1.0})
    with torch.no_grad():
        back = import_model(out).model()(images).logits
    diffs = {"vit_hub_vs_timm": float((ours - theirs).abs().max()), "reimported_vs_vit_hub": float((back - ours).abs().max())}
    print(f"published {out}: max |logit diff| {diffs}", flush=True)
    if max(diffs.values()) > 1e-4:
        raise SystemExit(f"parity lost publishing through timm: {diffs}")
    return out


def make_parity(root: Path, train_per_class: int = 60, test_per_class: int = 500) -> Path:
    """`ROOT/parity/{train,test}/{even,odd}/*.png` from the bundled MNIST test split."""
    raw = ROOT / "vit_hub" / "bundled" / "MNIST" / "raw"
    with gzip.open(raw / "t10k-images-idx3-ubyte.gz") as images, gzip.open(raw / "t10k-labels-idx1-ubyte.gz") as labels:
        digits = np.frombuffer(images.read()[16:], dtype=np.uint8).reshape(-1, 28, 28)  # [10000, 28, 28]
        classes = np.where(np.frombuffer(labels.read()[8:], dtype=np.uint8) % 2 == 0, "even", "odd")
    folder = root / "parity"
    for name in ("even", "odd"):
        chosen = np.flatnonzero(classes == name)
        for split, indices in (("train", chosen[:train_per_class]),
                               ("test", chosen[train_per_class:train_per_class + test_per_class])):
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for index in indices:
                Image.fromarray(digits[index]).save(folder / split / name / f"{index:05d}.png")
    return folder


TARGETS = {"parity": make_parity, "shapes": lambda root: make_shapes_tiny(root, seed=0)}


def final_accuracy(metrics: dict) -> dict:
    return {"test": metrics["final"]["accuracy"], "n": metrics["final"]["n"],
            "best_val": metrics["best_val_accuracy"], "epochs": metrics["epochs"]}


def run_with_layer_decay(decay: float, argv: list[str]) -> int:
    """`vit-hub` with layer-wise learning-rate decay: each block's rate is the next one's times
    `decay` (head and final norm at the full rate, the patch embedding and positions lowest).
    Done by replacing vit_hub.train.step's parameter groups and AdamW in this process only."""
    import vit_hub.train.step as training
    from vit_hub.cli import main as cli_main

    def parameter_groups(model, weight_decay: float) -> list[dict]:
        depth = model.config.depth
        groups = []
        for name, parameter in model.named_parameters():
            if name.startswith("blocks."):
                layer = int(name.split(".")[1]) + 1
            elif name.startswith(("head.", "norm.", "pre_logits.")):
                layer = depth + 1
            else:  # patch embedding, class token, positions
                layer = 0
            no_decay = parameter.ndim <= 1 or name.endswith(("pos_embedding", "cls_token", "cls_position"))
            groups.append({"params": [parameter], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": decay ** (depth + 1 - layer)})
        return groups

    class ScaledAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            rates = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = group["lr"] * group["lr_scale"]
            try:
                return super().step(closure)
            finally:
                for group, rate in zip(self.param_groups, rates):
                    group["lr"] = rate

    training.parameter_groups = parameter_groups
    torch.optim.AdamW = ScaledAdamW
    return cli_main(argv)


def main() -> None:
    if sys.argv[1:2] == ["--layer-decay-run"]:
        raise SystemExit(run_with_layer_decay(float(sys.argv[2]), sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the data, runs and results")
    parser.add_argument("--target", choices=sorted(TARGETS), default="parity", help="the small dataset")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=50, help="budget of every run on the small set")
    parser.add_argument("--pretrain-epochs", type=int, default=2)
    parser.add_argument("--variants", default="init,init-lr5e-4,scratch,default")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    published = publish_as_timm(pretrain(args.work, args.pretrain_epochs), args.work)
    pretrained_metrics = json.loads((args.work / "pretrained" / "metrics.json").read_text())
    data = TARGETS[args.target](args.work / "data")
    budget = ["--epochs", str(args.epochs), "--workers", "0", "--overwrite"]
    variants = {
        "init": ["--init", str(published)],
        # the same start at the from-scratch learning rate (1e-3 per 128 images; batch 32 here)
        "init-lr5e-4": ["--init", str(published), "--lr", "5e-4"],
        "init-llrd": ["--init", str(published)],
        "scratch": ARCHITECTURE,
        "default": [],
    }
    results_path = args.work / f"results_{args.target}.json"  # runs of other --variants are kept
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": {}}
    results.update(pretrained=final_accuracy(pretrained_metrics), target=args.target)
    for variant in args.variants.split(","):
        for seed in args.seeds.split(","):
            run = f"{args.target}_{variant}_{seed}"
            metrics = vit_hub("train", "--data", str(data), *variants[variant], *budget, "--seed", seed,
                              "--out", str(args.work / run), log=args.work / f"{run}.log",
                              layer_decay=0.75 if variant == "init-llrd" else None)
            results["runs"].setdefault(variant, {})[seed] = final_accuracy(metrics)
            print(f"{variant} seed {seed}: {results['runs'][variant][seed]}", flush=True)
            results_path.write_text(json.dumps(results, indent=2) + "\n")
    print("| start | " + " | ".join(f"seed {seed}" for seed in args.seeds.split(",")) + " | mean |")
    print("|---|" + "---|" * (len(args.seeds.split(",")) + 1))
    for variant, runs in results["runs"].items():
        accuracies = [run["test"] for run in runs.values()]
        print(f"| {variant} | " + " | ".join(f"{value:.3f}" for value in accuracies)
              + f" | {sum(accuracies) / len(accuracies):.3f} |")


if __name__ == "__main__":
    main()
