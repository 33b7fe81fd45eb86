"""Every shell block of README.md and docs/*.md, run as written by bash from the repo root after
the README's activation line, with a PATH that does not hold the venv (as in a new shell).

Placeholders and long runs are filled in with tiny settings: each block has an entry in
RUNNERS (keyed by its first line, unique across the pages) naming the substitutions made, and
every substitution must still match the page, so a reworded block fails here until its runner
is updated. The pages' Python blocks run through pytest-markdown-docs (fixtures in
../conftest.py; pyproject's testpaths name README.md and docs/).

Nothing here writes into the repo: `runs/` goes to a temporary folder, and the bundled model
and samples are checked unchanged afterwards.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hub_double import HubDouble
from markdown_it import MarkdownIt
from PIL import Image

from conftest import TINY_TRAIN_FLAGS, free_port, tiny_config
from test_streams import shards  # noqa: F401  (a fixture: parquet and tar shards of generated photos)
from vit_hub.layout import ExportLayout, ModelDir

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]  # the README and the pages it links
NODE_README = REPO / "examples" / "node" / "README.md"  # the Node example's own page, its blocks run from its folder
ACTIVATE = ". .venv/bin/activate"
VENV_BIN = REPO / ".venv" / "bin"
TOKEN = "hf_vitHubReadmeToken0123456789abcdef"
TINY = " ".join(TINY_TRAIN_FLAGS)
# A model of the sweep's kind small enough for 1-epoch runs (embed dim 16 divides by 8 heads).
TINY_SWEEP = "--image-size 16 --patch-size 4 --embed-dim 16 --depth 1 --batch-size 16 --augment none " \
             "--workers 0 --device cpu"
MNIST_RAW = REPO / "vit_hub" / "bundled" / "MNIST" / "raw"


# Reading the pages ---------------------------------------------------------------------------
def fences(page: Path, language: str) -> list[str]:
    """The text of every ```language block of a page, in order."""
    tokens = MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8"))
    return [token.content for token in tokens if token.type == "fence" and token.info.split()[:1] == [language]]


def bash_blocks() -> dict[str, str]:
    """{first line: block text} for every ```bash block of every page."""
    blocks = [block for page in (*PAGES, NODE_README) for block in fences(page, "bash")]
    first_lines = [block.splitlines()[0].strip() for block in blocks]
    assert len(set(first_lines)) == len(first_lines), f"two bash blocks start alike: {first_lines}"
    return dict(zip(first_lines, blocks))


def block(first_line: str) -> str:
    blocks = bash_blocks()
    assert first_line in blocks, f"no page has a bash block starting with {first_line!r}"
    return blocks[first_line]


def substitute(text: str, substitutions: list[tuple[str, str]]) -> str:
    """Each (old, new) in turn; every `old` must occur, so a stale runner fails."""
    for old, new in substitutions:
        assert old in text, f"README block no longer contains {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


# Running a block ------------------------------------------------------------------------------
def shell_env(**extra: str) -> dict[str, str]:
    """The environment of a new shell: no venv on PATH, offline, one thread, a private HF home."""
    path = [entry for entry in os.environ.get("PATH", "").split(os.pathsep)
            if entry and Path(entry).resolve() != VENV_BIN.resolve() and Path(entry) != Path(sys.prefix) / "bin"]
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "HF_TOKEN", "PYTHONPATH")}
    env.update(PATH=os.pathsep.join(path), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               GRADIO_ANALYTICS_ENABLED="False", MPLBACKEND="Agg")
    env.update(extra)
    return env


def script(text: str) -> str:
    return f"set -euo pipefail\n{ACTIVATE}\n{text}"


def run_block(text: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", script(text)], cwd=REPO, env=env or shell_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{text}\n--- stdout\n{done.stdout[-3000:]}\n" \
                                 f"--- stderr\n{done.stderr[-3000:]}"
    return done


# Fixtures -------------------------------------------------------------------------------------
def _snapshot(folders: list[Path]) -> dict[str, str]:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()
            for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module", autouse=True)
def repo_files_unchanged():
    """The README's examples never write into the bundled model or the samples."""
    folders = [REPO / "models", REPO / "vit_hub" / "bundled" / "samples"]
    before = _snapshot(folders)
    yield
    assert _snapshot(folders) == before, "a README block changed files under models/ or the bundled samples"


@pytest.fixture
def folder(split_image_folder) -> Path:
    """`path/to/folder`: conftest's folder of two classes of generated photos (train/ and test/)."""
    return split_image_folder


def _mnist_digits(name: str, per_class: int) -> list[tuple[np.ndarray, int]]:
    """The first `per_class` digits of each class from a bundled MNIST split ('train' or 't10k')."""
    with gzip.open(MNIST_RAW / f"{name}-images-idx3-ubyte.gz") as images_file, \
            gzip.open(MNIST_RAW / f"{name}-labels-idx1-ubyte.gz") as labels_file:
        labels = np.frombuffer(labels_file.read()[8:], dtype=np.uint8)[:2000]
        images = np.frombuffer(images_file.read(16 + 2000 * 784)[16:], dtype=np.uint8).reshape(-1, 28, 28)
    chosen = [index for digit in range(10) for index in np.flatnonzero(labels == digit)[:per_class]]
    return [(images[index], int(labels[index])) for index in chosen]


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory) -> Path:
    """`--data mnist` made tiny: 8 training and 3 test digits per class from the bundled copy."""
    root = tmp_path_factory.mktemp("tiny_mnist")
    for split, name, per_class in (("train", "train", 8), ("test", "t10k", 3)):
        for index, (pixels, label) in enumerate(_mnist_digits(name, per_class)):
            (root / split / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(root / split / str(label) / f"{index:03d}.png")
    return root


# The blocks -----------------------------------------------------------------------------------
SETUP = "make app    # installs into .venv, then serves the Gradio app on the bundled MNIST model: http://127.0.0.1:7860"
ACTIVATION = "make install            # once (make app and make test do it too): the package and its commands into .venv"
QUICK_START = "vit-hub train --data path/to/folder --out runs/scratch     # from scratch; folder/<class>/<image>"
TRAIN = "vit-hub train --data path/to/folder --out runs/my-model"
AFTER_TRAIN = "vit-hub train --resume --out runs/my-model          # continue (also after Ctrl-C): same result as uninterrupted"
BUNDLED = ("vit-hub train --data mnist --init models/vit-mnist --canonicalize digit --lr 1e-4 --epochs 6 "
           "--out /tmp/ft/vit-mnist --device cpu --workers 1")  # the bundled card's command
EXPORT = "vit-hub export --model models/vit-mnist --out runs/onnx --output-attentions --quantize int8 --calib-data mnist"
HUB = "export HF_TOKEN=hf_...            # or `hf auth login`, or --token (a flag is visible to other users)"
DDP = "# one machine, 4 GPUs (or 4 CPU processes); then resume the run the same way"
TWO_MACHINES = "# two machines, 8 GPUs each: run this on both, HOST being the first machine's address, with"
PRETRAINED = "vit-hub import timm/vit_base_patch16_224.augreg2_in21k_ft_in1k --out runs/vit-base"
NODE = "cd examples/node && ONNXRUNTIME_NODE_INSTALL_CUDA=skip npm ci"
GPU_SERVER = 'python examples/gpu_server.py --model models/vit-mnist --port 8000 &   # prints "serving ..." once it listens'
NODE_MAP = ("cd examples/node && node classify.mjs ../../models/vit-mnist "
            "../../vit_hub/bundled/samples/mnist_test_0000_label_7.png --map overlay.png")
NODE_INSTALL = "ONNXRUNTIME_NODE_INSTALL_CUDA=skip npm ci --no-audit --no-fund"
HUB_DATA = "vit-hub train --data hf://datasets/OWNER/NAME --out runs/hub                  # fetched into the HF cache"
NODE_RUN = ("node classify.mjs ../../models/vit-mnist ../../vit_hub/bundled/samples/mnist_test_0000_label_7.png "
            "../../vit_hub/bundled/samples/mnist_test_0001_label_2.png")
NODE_RUN_MAP = ("node classify.mjs ../../models/vit-mnist ../../vit_hub/bundled/samples/mnist_test_0000_label_7.png "
                "--map overlay.png")
RUNNERS = {SETUP, ACTIVATION, QUICK_START, TRAIN, AFTER_TRAIN, BUNDLED, EXPORT, HUB, DDP, TWO_MACHINES, PRETRAINED,
           NODE, NODE_MAP, GPU_SERVER, NODE_INSTALL, NODE_RUN, NODE_RUN_MAP, HUB_DATA}


def test_every_bash_block_has_a_runner():
    assert set(bash_blocks()) == RUNNERS, "a bash block was added, removed or reworded: update RUNNERS"


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text(encoding="utf-8")
    assert [page.name for page in PAGES[1:] if f"](docs/{page.name})" not in readme] == []


def test_the_readme_starts_with_the_two_setup_commands():
    """The README's first block; `make test` is what CI runs (.ci/run); `make app` is run below."""
    assert fences(README, "bash")[0] == block(SETUP) and README.read_text().index("```bash") < 20
    lines = [line.split("#")[0].strip() for line in block(SETUP).splitlines()]
    assert lines == ["make app", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_make_app_serves_the_bundled_model_without_a_share_hint():
    """`make app` as written (already installed: `-o` keeps make from reinstalling), on a free
    port through GRADIO_SERVER_PORT; stopped with SIGTERM."""
    port = free_port()
    process = subprocess.Popen(["make", "-s", "-o", ".venv/.installed", "app"], cwd=REPO, start_new_session=True,
                               env=shell_env(GRADIO_SERVER_PORT=str(port)), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        status = _wait_for_http(f"http://127.0.0.1:{port}/", process, timeout=180)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert status == 200, output
    assert f"app.py: serving {REPO / 'models' / 'vit-mnist'} (torch (CPU)) at http://127.0.0.1:{port}" in output
    assert "share=True" not in output and "Traceback" not in output, output


def _wait_for_http(url: str, process: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status
        except OSError:
            time.sleep(1)
    return -1


def test_the_activation_line_puts_the_commands_on_path():
    text = substitute(block(ACTIVATION), [("make install ", "make -s -o .venv/.installed install ")])
    assert ACTIVATE in text
    done = run_block(text + "\ncommand -v vit-hub torchrun\nvit-hub --help\npython -m vit_hub.export --help\n"
                            "python -c 'import torch, export'")
    assert done.stdout.splitlines()[:2] == [str(VENV_BIN / "vit-hub"), str(VENV_BIN / "torchrun")]
    for command in ("train", "eval", "predict", "info", "sweep", "push", "pull"):
        assert command in done.stdout


@pytest.mark.slow
def test_train_then_resume_eval_predict_info_and_sweep(folder, tiny_mnist, tmp_path):
    images = sorted((folder / "test").rglob("*.png"))[:2]
    train = substitute(block(TRAIN), [
        ("path/to/folder", str(folder)),
        ("--out runs/my-model", f"--out {tmp_path}/runs/my-model {TINY} --epochs 2 --stop-after-epochs 1")])
    assert "paused after epoch 1 of 2" in run_block(train).stdout

    after = substitute(block(AFTER_TRAIN), [
        ("path/to/folder", str(folder)), ("img1.jpg img2.png", " ".join(map(shlex.quote, map(str, images)))),
        ("--data mnist", f"--data {tiny_mnist}"), ("--epochs 2", f"--epochs 1 {TINY_SWEEP}"),
        ("runs/", f"{tmp_path}/runs/")])
    out = run_block(after, timeout=600).stdout
    evaluation = json.loads(next(line for line in out.splitlines() if line.startswith('{"accuracy"')))
    assert evaluation["split"] == "val" and evaluation["n"] > 0
    assert sum(line.startswith(str(path)) for path in images for line in out.splitlines()) == 2
    assert out.count("is finished; reading its metrics.json") == 3  # the --resume line: nothing left to run
    assert (tmp_path / "runs" / "heads" / "sweep.md").read_text().count("| num_heads |") == 3


@pytest.mark.slow
def test_the_bundled_models_recipe_trains(tiny_mnist, tmp_path):
    text = substitute(block(BUNDLED), [
        ("--data mnist", f"--data {tiny_mnist}"), ("--epochs 6", "--epochs 1"), ("--workers 1", "--workers 0"),
        ("/tmp/ft/", f"{tmp_path}/runs/")])
    run_block(text)
    assert json.loads((tmp_path / "runs" / "vit-mnist" / "config.json").read_text())["canonicalize"] == "digit"


@pytest.mark.slow
def test_the_onnx_export_writes_a_scratch_folder(tmp_path):
    text = substitute(block(EXPORT), [("--calib-data mnist", "--calib-data mnist --eval-limit 32"),
                                      ("runs/", f"{tmp_path}/runs/")])
    closing = run_block(text).stdout.strip().splitlines()[-1]
    written = ["model.onnx", "model_attentions.onnx", "pipeline.onnx", "pipeline_map.onnx", "pipeline_explain.onnx",
               "preprocess.onnx",
               "model_int8.onnx", "config.json", "model_export_report.json"]
    assert closing == f"wrote {tmp_path}/runs/onnx/: {', '.join(written)}"
    assert all((tmp_path / "runs" / "onnx" / name).is_file() for name in written)
    assert "created" not in json.loads((tmp_path / "runs" / "onnx" / "model_export_report.json").read_text())


def test_gpu_server_block_classifies_a_sample(tmp_path):
    """docs/export.md's server on a free port, waited for, asked once, stopped (on the CPU here)."""
    port = free_port()
    waiting = tmp_path / "wait_for_server.py"
    waiting.write_text(WAIT_FOR_APP)
    text = substitute(block(GPU_SERVER), [
        ("--port 8000 &", f"--port {port} & server=$!; python {waiting} {port};"),
        ("http://127.0.0.1:8000/classify", f"http://127.0.0.1:{port}/classify; kill $server; wait $server || true")])
    reply = json.loads(run_block(text).stdout.strip().splitlines()[-1])
    assert reply["label"] == "7" and reply["top"][0][0] == "7"


def test_node_block_classifies_a_sample_without_python():
    """The Node example as docs/export.md runs it; `make install-dev` ran its `npm ci` already,
    so here npm only checks that the pinned packages are there."""
    text = substitute(block(NODE), [("npm ci", "npm ls --depth=0 >/dev/null")])
    rows = [json.loads(line) for line in run_block(text).stdout.splitlines()]
    assert [row["label"] for row in rows] == ["7"] and rows[0]["top"][0][1] > 0.5


def test_node_map_block_writes_the_overlay(tmp_path):
    text = substitute(block(NODE_MAP), [("--map overlay.png", f"--map {tmp_path}/overlay.png")])
    (row,) = [json.loads(line) for line in run_block(text).stdout.splitlines()]
    assert row["label"] == "7" and len(row["map"]) == 7 and (tmp_path / "overlay.png").stat().st_size > 1000


def test_the_node_readme_installs_runs_and_draws_the_map(tmp_path):
    """examples/node/README.md's blocks, run from its folder as it says; `make install-dev` ran
    the `npm ci` already, so npm only checks the pinned packages are there."""
    node = "cd examples/node\n"
    run_block(node + substitute(block(NODE_INSTALL), [("npm ci --no-audit --no-fund", "npm ls --depth=0 >/dev/null")]))
    rows = [json.loads(line) for line in run_block(node + block(NODE_RUN)).stdout.splitlines()]
    assert [row["label"] for row in rows] == ["7", "2"] and all(len(row["top"]) == 3 for row in rows)
    text = substitute(block(NODE_RUN_MAP), [("--map overlay.png", f"--map {tmp_path}/overlay.png")])
    (row,) = [json.loads(line) for line in run_block(node + text).stdout.splitlines()]
    assert row["label"] == "7" and row["overlay"] == f"{tmp_path}/overlay.png" and len(row["map"]) == 7


def test_npm_runs_no_install_script_the_node_example_has_not_decided_on():
    """npm 11 runs a dependency's install script only when package.json's allowScripts names it,
    and ends `npm ci` with a warning for each one it does not name: every package the lock
    marks as having one is named (onnxruntime-node's, denied: it only downloads CUDA libraries)."""
    package = json.loads((REPO / "examples" / "node" / "package.json").read_text())
    lock = json.loads((REPO / "examples" / "node" / "package-lock.json").read_text())
    scripted = {name.rpartition("node_modules/")[2] for name, entry in lock["packages"].items()
                if entry.get("hasInstallScript")}
    assert scripted and scripted <= set(package.get("allowScripts", {})), (scripted, package.get("allowScripts"))


def named_files(text: str) -> set[str]:
    """The file names a page's text writes in backticks (`model.onnx`, `config.json`)."""
    return set(re.findall(r"`([\w.]+\.(?:onnx|json))`", text))


def paragraph(page: Path, holding: str) -> str:
    """The paragraph of a page that holds `holding`, its lines joined."""
    return next(" ".join(text.split()) for text in page.read_text(encoding="utf-8").split("\n\n") if holding in text)


def test_the_pages_name_every_file_an_export_writes_and_a_push_uploads():
    """The lists of files are written by hand; these are the files vit_hub.layout names."""
    layout = ModelDir(Path()).export
    half = {ExportLayout.in_precision(graph, "fp16").name for graph in (layout.logits, layout.attentions, layout.pipeline)}
    shipped = {path.name for path in layout.onnx_files}
    assert half <= shipped  # what --precision fp16 adds, which the export block does not ask for
    written = paragraph(REPO / "docs" / "export.md", "writes `runs/onnx/`:")
    assert named_files(written) == shipped - half | {layout.int8.name, layout.config.name}, written
    pushed = paragraph(REPO / "docs" / "hub.md", "`--with-onnx` adds").partition("`--with-onnx` adds")[2]
    pushed = pushed.partition("; without")[0]  # the sentence's list
    assert named_files(pushed) == shipped | {layout.int8.name} and f"never `{layout.int8.name}`" in pushed, pushed


@pytest.mark.slow
def test_hub_block_against_a_local_hub_and_offline(tmp_path):
    """A real push needs the Hub: here it goes to tests/hub_double.py's stand-in. Offline (the
    first line of the block also run alone) every command fails with one error line."""
    text = substitute(block(HUB), [("hf_...", TOKEN), ("runs/", f"{tmp_path}/runs/")])
    with HubDouble(TOKEN) as hub:
        env = shell_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="0")
        out = run_block(text, env).stdout
    assert hub.unexpected == [] and len(hub.commits) == 1
    assert {"model.onnx", "model_attentions.onnx", "model.safetensors"} <= set(hub.commits[0].files)
    assert (tmp_path / "runs" / "from-hub" / "model.safetensors").is_file()
    digits = list((REPO / "vit_hub" / "bundled" / "samples").glob("*.png"))
    assert sum(line.startswith("vit_hub/bundled/samples/") for line in out.splitlines()) == len(digits)

    commands = [line for line in text.splitlines() if line.startswith("vit-hub ")]
    for command in commands:
        offline = subprocess.run(["bash", "-c", script(command.split("#")[0])], cwd=REPO, capture_output=True,
                                 text=True, timeout=120, env=shell_env(HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "off")))
        lines = offline.stderr.strip().splitlines()
        assert offline.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), offline.stderr


@pytest.mark.slow
def test_pretrained_block_against_a_local_hub(folder, tmp_path):
    """The two repos the block names, served by the local Hub stand-in: small random models with
    the same library layout (a timm ViT saved as timm saves it, with that architecture name; a
    transformers ViTModel with its pooler). The fine-tuning run is cut to one epoch."""
    import timm  # test dependencies: a missing one fails, never skips
    import transformers
    from huggingface_hub import HfApi

    sources = tmp_path / "sources"
    timm.models.save_for_hf(timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                              embed_dim=32, depth=2, num_heads=2),
                            sources / "timm", safe_serialization=True)
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                 intermediate_size=64, image_size=32, patch_size=8)
                          ).save_pretrained(sources / "hf", safe_serialization=True)
    photo = tmp_path / "photo.jpg"
    Image.fromarray((np.random.default_rng(0).random((60, 80, 3)) * 255).astype(np.uint8)).save(photo)
    text = substitute(block(PRETRAINED), [("runs/", f"{tmp_path}/runs/"), ("path/to/photo.jpg", str(photo)),
                                          ("path/to/folder", str(folder)),
                                          ("runs/my-fine-tuned", "runs/my-fine-tuned --epochs 1 --workers 0")])
    with HubDouble(TOKEN) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        for repo_id, files in (("timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", "timm"),
                               ("google/vit-base-patch16-224-in21k", "hf")):
            api.create_repo(repo_id)
            api.upload_folder(repo_id=repo_id, folder_path=sources / files)
        out = run_block(text, shell_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"),
                                        HF_HUB_OFFLINE="0")).stdout
    assert "imported timm vit_base_patch16_224.augreg2_in21k_ft_in1k" in out
    assert f"{photo}: " in out  # one line of ImageNet labels for the photo
    tuned = json.loads((tmp_path / "runs" / "my-fine-tuned" / "source.json").read_text())
    assert (tuned["kind"], tuned["source"]) == ("fine-tuned", "google/vit-base-patch16-224-in21k")


# Waits for the app the quick start serves (its port in argv[1]), then returns.
WAIT_FOR_APP = ("import sys, time, urllib.request\n"
                "for _ in range(240):\n"
                "    try: urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/', timeout=5); break\n"
                "    except OSError: time.sleep(1)\n"
                "else: sys.exit('the app never answered')\n")


@pytest.mark.slow
def test_quick_start_from_scratch_and_pretrained_to_the_app(folder, shards, tmp_path):  # noqa: F811
    """The README's quick start, each run cut to one epoch: the --init repo is a small random
    timm ViT saved as timm saves it, served with the push target by the local Hub stand-in;
    the app is served on a free port until it answers, then stopped."""
    import timm  # test dependency: a missing one fails, never skips
    from huggingface_hub import HfApi

    source = tmp_path / "timm"
    timm.models.save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                              embed_dim=32, depth=2, num_heads=2),
                            source, safe_serialization=True)
    photo = tmp_path / "photo.jpg"
    Image.fromarray((np.random.default_rng(0).random((60, 80, 3)) * 255).astype(np.uint8)).save(photo)
    port = free_port()
    serve = "python app.py --model runs/tuned --backend onnx"
    script_file = tmp_path / "wait_for_app.py"
    script_file.write_text(WAIT_FOR_APP)
    text = substitute(block(QUICK_START), [
        ("path/to/folder --out runs/scratch", f"{folder} --out runs/scratch {TINY} --epochs 1"),
        # the dataset's shards from a local folder in the Hub's layout (the Hub id itself: HUB_DATA's test)
        ("hf://datasets/OWNER/NAME --out runs/hub", f"{shards}/parquet --out runs/hub {TINY} --epochs 1"),
        ("--init timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k",
         "--init timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k --epochs 1 --workers 0"),
        ("path/to/folder", str(folder)), ("path/to/photo.jpg", str(photo)),
        (serve, f"{serve} --port {port} & app=$!; python {script_file} {port}; kill $app; wait $app || true"),
        ("runs/", f"{tmp_path}/runs/")])
    with HubDouble(TOKEN) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k")
        api.upload_folder(repo_id="timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", folder_path=source)
        out = run_block(text, shell_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="0",
                                        HF_TOKEN=TOKEN), timeout=900).stdout
    assert (tmp_path / "runs" / "scratch" / "model.safetensors").is_file()
    tuned = json.loads((tmp_path / "runs" / "tuned" / "source.json").read_text())
    assert tuned["source"] == "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    assert json.loads(next(line for line in out.splitlines() if line.startswith('{"accuracy"')))["n"] > 0
    assert f"{photo}: " in out
    pushed = [commit for commit in hub.commits if "model.onnx" in commit.files]
    assert len(pushed) == 1 and "model_attentions.onnx" in pushed[0].files


@pytest.mark.slow
def test_ddp_blocks_with_two_processes_and_two_nodes(folder, tmp_path):
    one_machine = substitute(block(DDP), [
        ("--nproc_per_node 4", "--nproc_per_node 2"),
        ("path/to/folder --out runs/ddp", f"{folder} --out {tmp_path}/runs/ddp {TINY} --epochs 2 --stop-after-epochs 1"),
        ("runs/ddp\n", f"{tmp_path}/runs/ddp\n")])
    run_block(one_machine)
    assert len(json.loads((tmp_path / "runs" / "ddp" / "metrics.json").read_text())["history"]) == 2

    two_machines = substitute(block(TWO_MACHINES), [
        ("--nproc_per_node 8", "--nproc_per_node 1"), ("HOST:29500", f"127.0.0.1:{free_port()}"),
        ("/shared/folder", str(folder)), ("/shared/runs/ddp", f"{tmp_path}/ddp2 {TINY} --epochs 1")])
    nodes = [subprocess.Popen(["bash", "-c", script(two_machines)], cwd=REPO, env=shell_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    assert (tmp_path / "ddp2" / "model.safetensors").is_file()


def hub_cache(parquet: Path, cache: Path, repo_id: str) -> Path:
    """The Hugging Face cache after fetching `repo_id` at main (its shards in data/) and at the
    tag v1.0 (the same shards as the config small/), as snapshot_download leaves it."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    for ref, commit, folder in (("main", "0" * 40, "data"), ("v1.0", "1" * 40, "small")):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(parquet / "data", snapshot / folder)
        (snapshot / "README.md").write_text("---\nlicense: mit\n---\n")
        (repo / "refs" / ref).write_text(commit)
    return cache


@pytest.mark.slow
def test_hub_dataset_and_streamed_blocks(shards, tmp_path):  # noqa: F811 (the fixture imported above)
    """training.md's Hugging Face block: a Hub id and a tagged config from a filled cache with
    HF_HUB_OFFLINE=1, parquet shards streamed, and tar shards under torchrun (2 processes)."""
    runs = tmp_path / "runs"
    text = substitute(block(HUB_DATA), [
        ("hf://datasets/OWNER/NAME --out runs/hub", f"hf://datasets/someone/shapes --out {runs}/hub {TINY} --epochs 1"),
        ("hf://datasets/OWNER/NAME@v1.0 --data-config small --out runs/hub-small",
         f"hf://datasets/someone/shapes@v1.0 --data-config small --out {runs}/hub-small {TINY} --epochs 1"),
        ("path/to/shards --stream --out runs/streamed",
         f"{shards}/parquet --stream --out {runs}/streamed {TINY} --epochs 1"),
        ("path/to/tar-shards --out runs/wds", f"{shards}/tar --out {runs}/wds {TINY} --epochs 1")])
    cache = hub_cache(shards / "parquet", tmp_path / "cache", "someone/shapes")
    run_block(text, shell_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"), timeout=900)
    for run in ("hub", "hub-small", "streamed", "wds"):
        assert (runs / run / "model.safetensors").is_file(), run


# The app section's promise: an ONNX export made at start-up does not outlive the app.
SIGTERM_AFTER_EXPORT = """
import os, signal, sys, time
from vit_hub.demo import backends, server
signal.signal(signal.SIGTERM, server._exit_on_sigterm)  # as server.main() sets it
print(backends.OnnxPredictor.load(sys.argv[1]).classifier.layout.folder, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
"""


@pytest.mark.slow
def test_the_apps_temporary_onnx_export_is_removed_on_sigterm(tmp_path):
    from vit_hub.hub.pretrained import HubVisionTransformer

    model_dir = tmp_path / "model"
    HubVisionTransformer(**tiny_config()).save_pretrained(model_dir)
    done = subprocess.run([sys.executable, "-c", SIGTERM_AFTER_EXPORT, str(model_dir)], cwd=REPO, env=shell_env(),
                          capture_output=True, text=True, timeout=300)
    exported = Path(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert exported.name.startswith("vit_hub_onnx_") and not exported.exists()


# Every module is in a file table ------------------------------------------------------------
def table_rows() -> str:
    return "\n".join(line for page in PAGES for line in page.read_text().splitlines() if line.startswith("|"))


MODULES = sorted(path.relative_to(REPO).as_posix() for folder in ("vit_hub", "export")
                 for path in (REPO / folder).rglob("*.py") if path.stem not in ("__init__", "__main__"))


@pytest.mark.parametrize("module", MODULES)
def test_every_module_has_a_row_in_a_file_table(module):
    """A reader finds each file from the README's pages: vit_hub's in a table by its path,
    export/'s in docs/export.md's table by its name."""
    rows = table_rows()
    if module.startswith("export/"):
        assert f"| `{Path(module).name}` |" in (REPO / "docs" / "export.md").read_text(), module
    else:
        assert f"[`{module}`](../{module})" in rows or f"[`{module}`]({module})" in rows, module


def test_the_file_table_check_finds_a_missing_module():
    assert len(MODULES) > 40 and "vit_hub/demo/page.py" in MODULES and "export/runtime.py" in MODULES
    assert "[`vit_hub/nothing.py`](../vit_hub/nothing.py)" not in table_rows()
