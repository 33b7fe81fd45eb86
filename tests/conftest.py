"""Shared fixtures: generated image folders and tiny model configs. Offline and deterministic.

Nothing here is autouse: every fixture is opt-in by name, so other test files are unaffected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

# Two classes a tiny model tells apart at a glance: a bright warm disc on a light
# background against a dark cool square on a dark background. Colour, brightness and
# shape all differ, so the classes stay apart even after conversion to grayscale.
CLASSES = {
    "bright_disc": dict(background=(235, 225, 200), shape="disc", colour=(250, 120, 40)),
    "dark_square": dict(background=(25, 35, 60), shape="square", colour=(40, 90, 200)),
}

# (PIL mode, file extension): every image mode the data pipeline must convert, in turn.
FORMATS = [
    ("RGB", "png"), ("RGB", "jpg"), ("L", "png"), ("L", "jpg"),
    ("RGBA", "png"), ("P", "png"), ("I;16", "png"), ("CMYK", "jpg"),
]


def draw_example(class_name: str, size: tuple[int, int], rng: np.random.Generator) -> Image.Image:
    """One RGB image of `class_name`, `size` = (width, height), with random placement and noise."""
    style = CLASSES[class_name]
    width, height = size
    image = Image.new("RGB", size, style["background"])
    draw = ImageDraw.Draw(image)
    side = int(min(width, height) * rng.uniform(0.45, 0.75))
    left = int(rng.integers(0, width - side + 1))
    top = int(rng.integers(0, height - side + 1))
    box = (left, top, left + side - 1, top + side - 1)
    if style["shape"] == "disc":
        draw.ellipse(box, fill=style["colour"])
    else:
        draw.rectangle(box, fill=style["colour"])
    noise = rng.normal(0, 8, size=(height, width, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def in_mode(image: Image.Image, mode: str) -> Image.Image:
    """An RGB image converted to `mode`, including the 16-bit grayscale mode I;16."""
    if mode == "I;16":
        gray = np.asarray(image.convert("L"), dtype=np.uint16) * 257  # full 16-bit range
        return Image.fromarray(gray)
    if mode == "RGBA":
        rgba = image.convert("RGBA")
        rgba.putalpha(230)
        return rgba
    if mode == "P":
        return image.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    return image.convert(mode)


def write_class_folders(root: Path, per_class: int, seed: int, start: int = 0) -> list[Path]:
    """`root/<class>/<n>.<ext>` for every class: mixed sizes, modes and PNG/JPEG. Returns the files."""
    rng = np.random.default_rng(seed)
    written = []
    for class_name in CLASSES:
        folder = root / class_name
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(start, start + per_class):
            mode, extension = FORMATS[index % len(FORMATS)]
            size = (int(rng.integers(18, 56)), int(rng.integers(18, 56)))  # non-square, never 16x16
            path = folder / f"{index:03d}_{mode.replace(';', '')}.{extension}"
            in_mode(draw_example(class_name, size, rng), mode).save(path)
            written.append(path)
    return written


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """One folder of class subfolders (split by --val-split): 2 x 24 images of mixed sizes,
    modes and formats, plus ONE corrupt file, `bright_disc/corrupt.png`."""
    root = tmp_path_factory.mktemp("image_folder")
    write_class_folders(root, per_class=24, seed=0)
    (root / "bright_disc" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a PNG")
    (root / "dark_square" / "notes.txt").write_text("not an image; ImageFolder ignores it\n")
    return root


@pytest.fixture(scope="session")
def corrupt_file(image_folder) -> Path:
    return image_folder / "bright_disc" / "corrupt.png"


@pytest.fixture(scope="session")
def split_image_folder(tmp_path_factory) -> Path:
    """`train/` and `test/` subfolders, no corrupt files: 2 x 16 training and 2 x 8 test images."""
    root = tmp_path_factory.mktemp("split_image_folder")
    write_class_folders(root / "train", per_class=16, seed=1)
    write_class_folders(root / "test", per_class=8, seed=2, start=100)
    return root


# The tiny architecture every test builds or trains (16x16 RGB, one block of width 16): a run
# of a few epochs on the generated folders takes seconds on a CPU.
TINY_MODEL = dict(image_size=16, patch_size=4, in_channels=3, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0)
# TrainSettings of a tiny, fast, deterministic run on one CPU process.
TINY_RUN = dict(batch_size=8, lr=3e-3, augment="none", num_workers=0, device="cpu", seed=0)


def tiny_config(**overrides) -> dict:
    """Keyword arguments of a tiny model: TINY_MODEL with two blocks and the folders' two labels."""
    return {**TINY_MODEL, "depth": 2, "labels": ["bright_disc", "dark_square"], **overrides}


def train_flags(values: dict) -> list[str]:
    """`vit-hub train` flags for TrainSettings fields and ViTConfig fields, spelled as the CLI does."""
    from vit_hub.train.settings import TrainSettings

    spelled = {field.name: field.metadata.get("flag") for field in dataclasses.fields(TrainSettings)}
    return [part for name, value in values.items()
            for part in (spelled.get(name) or "--" + name.replace("_", "-"), str(value))]


# The command-line flags of the same tiny run (a sweep or `vit-hub train` on the generated folders).
TINY_TRAIN_FLAGS = train_flags({**TINY_MODEL, **TINY_RUN})


def train_tiny(data: Path, out: Path, epochs: int = 3, **overrides) -> Path:
    """A tiny model trained with `train()` on a generated folder into `out` (seconds); returns `out`."""
    import contextlib
    import io

    from vit_hub.train.run import train
    from vit_hub.train.settings import TrainSettings

    settings = TrainSettings(data=str(data), out=str(out), model=dict(TINY_MODEL), epochs=epochs, **TINY_RUN)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(dataclasses.replace(settings, **overrides))
    return out


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def digit_on_paper(sample: Path, canvas=(480, 360), at=(60, 170), side=150, light=True,
                   speck=False) -> Image.Image:
    """An MNIST digit as a phone photo of paper: dark ink, off-centre, `light` falling off to
    the right and down, paper grain, and with `speck` a dot of dust in a corner."""
    ink = np.asarray(Image.open(sample).convert("L").resize((side, side), Image.Resampling.BICUBIC),
                     dtype=np.float64)
    width, height = canvas
    rows, cols = np.mgrid[0:height, 0:width]
    paper = np.full((height, width), 210.0)
    if light:
        paper += -60 * cols / width - 25 * rows / height
    paper += np.random.default_rng(0).normal(0, 4, paper.shape)
    left, top = at
    paper[top:top + side, left:left + side] -= 0.7 * ink  # ink absorbs light
    if speck:
        paper[10:13, width - 14:width - 11] -= 120
    return Image.fromarray(np.clip(paper, 0, 255).astype(np.uint8)).convert("RGB")


def free_port() -> int:
    """A TCP port nobody listens on right now, for a server a test starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_one_line(message: str, *fragments: str) -> str:
    """One line, no traceback, naming what was expected and what was found, with `fragments`."""
    lines = message.strip().splitlines()
    assert len(lines) == 1, message
    assert "Traceback" not in message and "expected" in lines[0], message
    assert re.search(r"\b(found|got)\b", lines[0]), message
    for fragment in fragments:
        assert fragment in lines[0], message
    return lines[0]


def run_app_main(*argv) -> str:
    """app.py's main(ARGV) must exit non-zero before serving: returns its one-line message."""
    from vit_hub.demo import server

    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(err):
        server.main([str(arg) for arg in argv])
    assert exit_.value.code not in (0, None)
    return err.getvalue() or str(exit_.value.code)


# The app over raw HTTP, as any client can call it ----------------------------------------------
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "vit-mnist"


@pytest.fixture(scope="module")
def server():
    """The app on the bundled model, served in this process on a free port: its URL."""
    import torch

    from vit_hub.demo.backends import TorchPredictor
    from vit_hub.demo.page import build_demo, serve

    threads = torch.get_num_threads()
    demo = build_demo(TorchPredictor.load(BUNDLED_MODEL))
    _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()
    torch.set_num_threads(threads)


def call(url: str, endpoint: str, data: list) -> tuple[str, object]:
    """POST /gradio_api/call/ENDPOINT, then read its event stream: (last event, its data)."""
    import httpx

    body = json.dumps({"data": data})  # as any client may send it: NaN and Infinity included
    response = httpx.post(f"{url}gradio_api/call/{endpoint}", content=body,
                          headers={"Content-Type": "application/json"}, timeout=120)
    response.raise_for_status()
    stream = httpx.get(f"{url}gradio_api/call/{endpoint}/{response.json()['event_id']}", timeout=120).text
    event, payload = re.findall(r"^event: (\w+)\ndata: (.*)$", stream, re.MULTILINE)[-1]
    return event, json.loads(payload)


def upload(url: str, path: Path) -> str:
    """Upload a file the way the page does; returns its path on the server."""
    import httpx

    with open(path, "rb") as handle:
        response = httpx.post(f"{url}gradio_api/upload", files={"files": (path.name, handle)}, timeout=60)
    response.raise_for_status()
    return response.json()[0]


def file_data(path: str, **extra) -> dict:
    """The file data a request sends for a file on the server (marked as Gradio's own)."""
    return {"path": path, "meta": {"_type": "gradio.FileData"}, **extra}


def python_app_map(predictor, path: Path, method: str = "rollout"):
    """The Python app's map of `method` (rollout: its default head fusion and discard ratio) of an
    upload, read as the app reads one, and the overlay it draws: (map [grid_h, grid_w], overlay
    int16 [h, w, 3])."""
    from vit_hub.demo.pictures import answer, explain
    from vit_hub.explain.rollout import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION
    from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image, to_model_domain

    view = to_model_domain(load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS)), predictor.config)
    drawn = explain(predictor, view, DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO, 3, method)
    chosen = answer(predictor, view, DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO, 3, method).method_map
    return chosen, np.asarray(drawn.overlay, dtype=np.int16)


def python_page_map(predictor, path: Path):
    """The map the Python page opens with for this model (`opening_method`: integrated gradients +
    gradient rollout for the bundled model) of an upload and its overlay, as python_app_map; and
    that method's name: (map, overlay, method)."""
    from vit_hub.demo.methods import opening_method

    method = opening_method(predictor)
    return (*python_app_map(predictor, path, method), method)


def assert_same_overlay(drawn: np.ndarray, expected: np.ndarray) -> None:
    """The same picture but for a colour one step along the colour map where a map value, within
    float round-off of the app's, rounds the other way (a few pixels in a thousand): no value
    off by more than 3 levels (a step of the colour map, halved by the blend, and the blend's
    rounding), at most 1 % of them off at all."""
    drawn = np.asarray(drawn, dtype=np.int16)
    assert drawn.shape == expected.shape
    off = np.abs(drawn - expected)
    assert off.max() <= 3 and (off > 0).mean() < 1e-2, (off.max(), (off > 0).mean())
