"""How faithful is each explanation? Blank the patches a map ranks highest and watch the class.

For each of N test images (the first N, or N from `--first`), every method ranks the patches for the class the model
predicts on the intact image. Then:

  deletion AUC   blank the patches most-important first and average the class's probability
                 over the curve from 0 to 100 % blanked, every 5 % (lower is better);
  insertion AUC  start from the blank image and restore the patches most-important first
                 (higher is better);
  drop at 10 / 30 %  the fall in the class's probability after blanking the top 10 / 30 % of
                 patches, as a multiple of the fall after blanking a random 10 / 30 %
                 (the mean of `--draws` random orders);
  ms/img         the method's CPU time for one image at batch 1 (forward pass included; median
                 of `--timing-images`, one thread).

"Blank" is `vit_hub.explain.blanking.blank_pixels`: black paper for a digit model, the training
set's mean colour for a colour model. Rows: every method in `vit_hub.explain.attribution.METHODS` and
in bench/other_methods.py (measured for comparison, not offered by the app), integrated
gradients at other step counts, the peers captum (integrated gradients on the
pixels, 32 steps) and pytorch-grad-cam (Grad-CAM on the last block), both from
requirements-bench.txt, a map that looks at no model (ink per patch for grayscale images,
colourfulness per patch for colour ones: "where is the object") and random.

    python bench/faithfulness.py [--model models/vit-mnist] [--data mnist] [--images 500] [--first 0]
    python bench/faithfulness.py --model DIR --data ROOT/marked       # bench/marked_objects.py
    python bench/faithfulness.py --graph models/vit-mnist/pipeline_explain.onnx \
        --methods integrated_gradients_rollout,rollout --no-peers --timing no --images 500

--graph adds the maps other apps get: the graph's `map` and `rollout` outputs (pipeline_explain.onnx,
or pipeline_map.onnx's `map`), computed with ONNX Runtime's CPU provider (one thread) from each
test image's decoded pixels, as an app gives it an upload; the curves are the same torch model's
on the same model pixels (the graph's model_input is the Python path's). --methods keeps only
those of the app's methods (and drops the other rows but random), for a quicker run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # marked_objects, other_methods, run from anywhere
from marked_objects import object_map  # noqa: E402
from other_methods import OTHER_METHODS  # noqa: E402

from vit_hub.data.sources import load_splits  # noqa: E402
from vit_hub.explain.attribution import METHODS, Method  # noqa: E402
from vit_hub.explain.blanking import blank_patches, blank_pixels  # noqa: E402
from vit_hub.explain.rollout import scale_maps  # noqa: E402
from vit_hub.explain.run import explain  # noqa: E402
from vit_hub.hub.pretrained import load_model  # noqa: E402
from vit_hub.processing.preprocess import preprocess_batch  # noqa: E402

POINTS = 21  # points on each curve: every 5 % of the patches
MapFn = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (pixels [B, C, H, W], classes [B]) -> [B, h, w]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/vit-mnist")
    parser.add_argument("--data", default="mnist", help="'mnist' or an image folder with a test split")
    parser.add_argument("--images", type=int, default=300, help="N images of the test split")
    parser.add_argument("--first", type=int, default=0, help="index of the first of them (another --first: "
                        "images a method was not chosen on)")
    parser.add_argument("--draws", type=int, default=3, help="random orders for the random row")
    parser.add_argument("--timing-images", type=int, default=30)
    parser.add_argument("--batch", type=int, default=50, help="images per explanation call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peers", action="store_true", help="skip captum and pytorch-grad-cam")
    parser.add_argument("--timing", choices=("yes", "no", "only"), default="yes",
                        help="no: AUCs only (run them beside other jobs); only: ms/img only (run it alone)")
    parser.add_argument("--graph", type=Path, help="also measure this pipeline graph's maps, with ONNX Runtime")
    parser.add_argument("--methods", help="comma-separated names in METHODS: measure only these of the app's methods")
    parser.add_argument("--write", type=Path, help="also write the methods' rows as JSON here (faithfulness.json "
                        "in a model dir: the app shows its methods' rows; tests check the bench-only ones)")
    return parser.parse_args()


def test_uploads(data: str, count: int, first: int = 0) -> list:
    """`count` images of the test split from index `first` on, as PIL images."""
    test = load_splits(data, val_split=0.0).test
    return [test[i][0] for i in range(first, min(first + count, len(test)))]


def test_images(data: str, count: int, config, first: int = 0) -> np.ndarray:
    """`count` images of the test split from index `first` on -> model pixels [N, C, H, W]."""
    return preprocess_batch(test_uploads(data, count, first), config)


def patch_order(maps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """maps [N, h, w] -> [N, h*w] patch indices, highest first; ties in random order."""
    flat = maps.reshape(len(maps), -1)
    return np.lexsort((rng.random(flat.shape), -flat), axis=-1)


def curves(model, pixels: np.ndarray, classes: np.ndarray, order: np.ndarray, config,
           images_at_once: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Deletion and insertion curves [N, patches + 1]: the class's probability with the top
    k = 0..patches patches blanked (deletion) or restored onto the blank image (insertion)."""
    parts = [_curves(model, pixels[i:i + images_at_once], classes[i:i + images_at_once],
                     order[i:i + images_at_once], config) for i in range(0, len(pixels), images_at_once)]
    return np.concatenate([d for d, _ in parts]), np.concatenate([i for _, i in parts])


def _curves(model, pixels: np.ndarray, classes: np.ndarray, order: np.ndarray, config,
            chunk: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    count, patches = order.shape
    blank = blank_pixels(config)
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(patches)[None].repeat(count, 0), axis=1)  # rank of every patch
    ranks = ranks.reshape(count, *config.grid_size)
    steps = curve_steps(patches)
    result = []
    for inserting in (False, True):
        chosen = ranks[:, None] < steps[None, :, None, None]  # [N, K, h, w]: within the top k
        if inserting:
            chosen = ~chosen  # blank all but the top k
        images = blank_patches(np.repeat(pixels, len(steps), 0), chosen.reshape(-1, *config.grid_size),
                               tuple(config.patch_size), blank)
        probabilities = []
        with torch.inference_mode():
            for start in range(0, len(images), chunk):
                logits = model(torch.from_numpy(images[start:start + chunk])).logits
                probabilities.append(logits.softmax(-1).numpy())
        probabilities = np.concatenate(probabilities).reshape(count, len(steps), -1)
        result.append(probabilities[np.arange(count), :, classes])
    return result[0], result[1]


def curve_steps(patches: int, points: int = POINTS) -> np.ndarray:
    """How many patches are blanked at each point of a curve: 0, 5 %, 10 %, ... 100 % of them
    (rounded; the 10 % and 30 % points are the drops reported)."""
    return np.unique(np.round(np.linspace(0, 1, points) * patches).astype(int))


def auc(curve: np.ndarray, patches: int) -> float:
    """Mean over images of the trapezoid area under each curve, x = share of patches blanked."""
    return float(np.trapezoid(curve, x=curve_steps(patches) / patches, axis=1).mean())


# Methods --------------------------------------------------------------------------------
def vit_hub_method(model, method: str | Method, **options) -> MapFn:
    return lambda pixels, classes: explain(model, pixels, method, classes, **options).maps


def model_free(config) -> tuple[str, MapFn]:
    """Ink per patch (grayscale) or colourfulness per patch (colour): looks at no model."""
    patch = tuple(config.patch_size)
    if config.in_channels == 1:
        blank = blank_pixels(config)

        def ink(pixels: np.ndarray, _classes: np.ndarray) -> np.ndarray:
            return per_patch((pixels > blank[None, :, None, None] + 1e-3).any(axis=1).astype(np.float32), config)
        return "ink per patch (looks at no model)", ink
    return "colourfulness per patch: where the objects are (looks at no model)", lambda p, _c: object_map(p, patch)


def captum_ig(model, config, steps: int = 32) -> MapFn:
    from captum.attr import IntegratedGradients

    method = IntegratedGradients(lambda x: model(x).logits)
    blank = torch.from_numpy(blank_pixels(config))[None, :, None, None]

    def attribute(pixels: np.ndarray, classes: np.ndarray) -> np.ndarray:
        inputs = torch.from_numpy(pixels)
        attributions = method.attribute(inputs, baselines=blank.expand_as(inputs), target=torch.from_numpy(classes),
                                        n_steps=steps, internal_batch_size=256)
        return scale_maps(per_patch(attributions.sum(1).detach().numpy(), config))
    return attribute


def grad_cam(model, config) -> MapFn:
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return model(x).logits

    def tokens_to_grid(tokens: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, D, h, w]
        return tokens[:, 1:].reshape(tokens.shape[0], *config.grid_size, -1).permute(0, 3, 1, 2)

    cam = GradCAM(Logits(), target_layers=[model.blocks[-1].attention_norm], reshape_transform=tokens_to_grid)

    def attribute(pixels: np.ndarray, classes: np.ndarray) -> np.ndarray:
        maps = cam(torch.from_numpy(pixels), targets=[ClassifierOutputTarget(int(c)) for c in classes])
        return scale_maps(per_patch(maps, config))
    return attribute


def per_patch(values: np.ndarray, config) -> np.ndarray:
    """[B, H, W] per-pixel values -> [B, h, w] sums per patch."""
    (grid_h, grid_w), (patch_h, patch_w) = config.grid_size, config.patch_size
    return values.reshape(len(values), grid_h, patch_h, grid_w, patch_w).sum(axis=(2, 4))


def graph_maps(graph: Path, uploads: list, classes: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The maps of a pipeline graph's outputs (map, and rollout where it has one) for each upload,
    run with ONNX Runtime's CPU provider on one thread -> [(row name, maps [N, h, w])]."""
    import onnxruntime as ort

    from vit_hub.export.pipeline_graph import decoded_pixels
    from vit_hub.layout import MAP_LABEL_KEY, PIPELINE_INPUT, PIPELINE_MAP, PIPELINE_OUTPUT, PIPELINE_ROLLOUT

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    outputs = [name for name in (PIPELINE_MAP, PIPELINE_ROLLOUT) if name in {o.name for o in session.get_outputs()}]
    label = session.get_modelmeta().custom_metadata_map.get(MAP_LABEL_KEY, "Attention rollout")
    started = time.perf_counter()
    answers = [session.run([PIPELINE_OUTPUT, *outputs], {PIPELINE_INPUT: decoded_pixels(image)}) for image in uploads]
    same = sum(int(answer[0].argmax()) == int(expected) for answer, expected in zip(answers, classes))
    print(f"  {graph.name}: {same}/{len(uploads)} labels as the torch model's, "
          f"{1000 * (time.perf_counter() - started) / len(uploads):.1f} ms per upload (wall, one thread)",
          file=sys.stderr, flush=True)
    names = {PIPELINE_MAP: label, PIPELINE_ROLLOUT: "Attention rollout"}
    return [(f"{names[output]}: `{graph.name}`'s `{output}`, ONNX Runtime CPU",
             np.stack([answer[1 + index] for answer in answers])) for index, output in enumerate(outputs)]


def rows_of(model, config, peers: bool, only: list[str] | None = None) -> list[tuple[str, MapFn]]:
    if only:
        return [(f"{METHODS[name].label} (`{name}`)", vit_hub_method(model, name)) for name in only]
    rows = [(f"{method.label} (`{name}`)", vit_hub_method(model, method))
            for name, method in (METHODS | OTHER_METHODS).items()]
    rows += [(f"Integrated gradients, {steps} steps", vit_hub_method(model, "integrated_gradients", steps=steps))
             for steps in (2, 8, 16)]
    if peers:
        rows += [("captum IntegratedGradients on the pixels, 32 steps (peer)", captum_ig(model, config)),
                 ("pytorch-grad-cam GradCAM, last block (peer)", grad_cam(model, config))]
    rows.append(model_free(config))
    return rows


def ms_per_image(attribute: MapFn, pixels: np.ndarray, classes: np.ndarray, count: int) -> float:
    """Median CPU time of this process per image at batch 1 (one thread): what the method costs
    when other jobs share the cores, where wall time would count their share too."""
    attribute(pixels[:1], classes[:1])  # warm-up
    times = []
    for index in range(min(count, len(pixels))):
        start = time.process_time()
        attribute(pixels[index:index + 1], classes[index:index + 1])
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = load_model(args.model).eval()
    config = model.config
    pixels = test_images(args.data, args.images, config, args.first)
    with torch.inference_mode():
        classes = model(torch.from_numpy(pixels)).logits.argmax(-1).numpy()
    patches = config.grid_size[0] * config.grid_size[1]
    steps = list(curve_steps(patches))
    k10, k30 = round(0.1 * patches), round(0.3 * patches)
    i10, i30 = steps.index(k10), steps.index(k30)  # their columns in the curves

    if args.timing == "only":
        print("| map | CPU ms/img (batch 1) |\n|---|---|")
        for name, attribute in rows_of(model, config, not args.no_peers):
            print(f"| {name} | {ms_per_image(attribute, pixels, classes, args.timing_images):.1f} |", flush=True)
        print(f"\nload average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}; one thread; "
              f"command: python {' '.join(sys.argv)}")
        return

    random_curves = [curves(model, pixels, classes, patch_order(rng.random((len(pixels), *config.grid_size)), rng),
                            config) for _ in range(args.draws)]
    random_deletion = np.mean([deletion for deletion, _ in random_curves], axis=0)
    base = random_deletion[:, 0].mean()
    random_drop = {k: base - random_deletion[:, i].mean() for k, i in ((k10, i10), (k30, i30))}

    table = []
    rows = rows_of(model, config, not args.no_peers, args.methods.split(",") if args.methods else None)
    if args.graph:  # precomputed maps [N, h, w], not MapFns
        rows += graph_maps(args.graph, test_uploads(args.data, args.images, args.first), classes)
    for name, attribute in rows:
        started = time.perf_counter()
        maps = attribute if isinstance(attribute, np.ndarray) else np.concatenate(
            [attribute(pixels[i:i + args.batch], classes[i:i + args.batch]) for i in range(0, len(pixels), args.batch)])
        deletion, insertion = curves(model, pixels, classes, patch_order(maps, rng), config)
        drops = [(base - deletion[:, i].mean()) / random_drop[k] for k, i in ((k10, i10), (k30, i30))]
        ms = ms_per_image(attribute, pixels, classes, args.timing_images) \
            if args.timing == "yes" and not isinstance(attribute, np.ndarray) else float("nan")
        table.append((name, auc(deletion, patches), auc(insertion, patches), *drops, ms))
        print(f"  {name}: {time.perf_counter() - started:.0f} s; deletion AUC {table[-1][1]:.4f}, insertion AUC "
              f"{table[-1][2]:.4f}", file=sys.stderr, flush=True)
    table.append(("random", float(np.mean([auc(deletion, patches) for deletion, _ in random_curves])),
                  float(np.mean([auc(insertion, patches) for _, insertion in random_curves])), 1.0, 1.0, float("nan")))

    best_deletion, best_insertion = min(row[1] for row in table), max(row[2] for row in table)
    print(f"model {args.model}, data {args.data}: {len(pixels)} test images from index {args.first}, {patches} patches of "
          f"{config.patch_size[0]}x{config.patch_size[1]}, blank = {', '.join(f'{v:.4f}' for v in blank_pixels(config))}; "
          f"mean probability of the predicted class {base:.4f}; random drops {random_drop[k10]:.4f} at "
          f"{k10} patches (10 %), {random_drop[k30]:.4f} at {k30} (30 %); {args.draws} random orders")
    print("| map | deletion AUC (lower better) | insertion AUC (higher better) | drop at 10 % vs random | "
          "drop at 30 % vs random | CPU ms/img (batch 1) |\n|---|---|---|---|---|---|")
    for name, deletion, insertion, drop10, drop30, ms in table:
        cells = [f"**{deletion:.3f}**" if deletion == best_deletion else f"{deletion:.3f}",
                 f"**{insertion:.3f}**" if insertion == best_insertion else f"{insertion:.3f}"]
        print(f"| {name} | {cells[0]} | {cells[1]} | {drop10:.1f}x | {drop30:.1f}x | "
              f"{'-' if np.isnan(ms) else f'{ms:.1f}'} |")
    print(f"\nload average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}; one thread; "
          f"command: python {' '.join(sys.argv)}")
    if args.write:
        write_rows(args, table, len(pixels))


def write_rows(args: argparse.Namespace, table: list[tuple], count: int) -> None:
    """{method name: {deletion_auc, insertion_auc}} for the methods the app offers and those kept
    in bench/other_methods.py (which stay in bench/ only while they measure worse), and the
    model-free and random rows, with how they were measured."""
    labels = {f"{method.label} (`{name}`)": name for name, method in (METHODS | OTHER_METHODS).items()}
    rows = {labels.get(name, name): {"deletion_auc": round(deletion, 4), "insertion_auc": round(insertion, 4)}
            for name, deletion, insertion, *_ in table if name in labels or "no model" in name or name == "random"}
    args.write.write_text(json.dumps({"images": count, "data": args.data, "command": "python " + " ".join(sys.argv),
                                      "methods": rows}, indent=2) + "\n")
    print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
