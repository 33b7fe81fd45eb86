"""`vit-hub space`: the Space folder it writes, its upload to the Hub test double, and the
written Space started the way the Hub starts one and queried through gradio_client.

A Space runs `python app.py` with no flags in its folder, reached through
GRADIO_SERVER_NAME and GRADIO_SERVER_PORT, with only what its requirements.txt installs.
The tests start a copy of the written folder so: the interpreter imports only what the
Space's requirements.txt installs (with their dependencies; torch, for one, is refused) and
not this checkout's own vit_hub (a sitecustomize removes the editable install's finder), so
a source missing from the folder or a package missing from the requirements fails here.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hub_double import serving_hub

from conftest import free_port
from vit_hub.cli import main
from vit_hub.hub.card import HUB_TAGS
from vit_hub.hub.repos import push_to_hub
from vit_hub.hub.space import MODEL_FOLDER, REQUIREMENTS, SETTINGS_FILE, SPACE_APP, read_settings, write_space

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLE = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"  # a 7
TOKEN = "hf_vitHubSpaceTestToken0123456789abcdef"
SPACE = "me/vit-mnist-demo"
MODEL_REPO = "me/vit-mnist"
# The address the Space's app is told to bind: not the app's own default (127.0.0.1), so a
# served page proves that GRADIO_SERVER_NAME was read; still this machine only.
SPACE_HOST = "127.0.0.2"
SPACE_PYTHON = '''
import importlib.metadata as metadata
import os
import sys

from packaging.requirements import Requirement

# Only what the Space folder holds: not this checkout's vit_hub (the editable install).
sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in getattr(finder, "__module__", "")]


def normal(name):
    return name.lower().replace("_", "-")


def installed_here(name):
    """The distribution installed here for a requirement: itself, or the one that provides its
    module (the onnxruntime of the Space is onnxruntime-gpu here)."""
    try:
        metadata.distribution(name)
        return name
    except metadata.PackageNotFoundError:
        return PROVIDERS[name.replace("-", "_").lower()][0]


def installed_with(names):
    """The distributions pip installs for `names` (their dependencies, transitively)."""
    found, todo = set(), list(names)
    while todo:
        name = normal(installed_here(todo.pop()))
        if name in found:
            continue
        found.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


class OnlyTheRequirements:
    """A package installed here but not by the Space's requirements.txt (torch, say) cannot be imported."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        top = name.partition(".")[0]
        owners = PROVIDERS.get(top, [])
        if owners and top not in OWN and not any(normal(owner) in ALLOWED for owner in owners):
            raise ModuleNotFoundError(f"No module named {top!r}: the Space's requirements.txt does not install it",
                                      name=top)
        return None


try:
    PROVIDERS = metadata.packages_distributions()  # top-level module -> distributions
    ALLOWED = installed_with(os.environ["SPACE_REQUIREMENTS"].split())
    OWN = {"app", "vit_hub"}  # the Space folder's own sources
    sys.meta_path.insert(0, OnlyTheRequirements)
except Exception as error:  # Python would only warn and start the app without the check
    print(f"sitecustomize: {error!r}", flush=True)
    os._exit(97)
'''


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with serving_hub(monkeypatch, tmp_path / "hf-cache", TOKEN) as double:
        yield double


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def front_matter(readme: str) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", readme, re.DOTALL)
    assert match, readme[:200]
    return yaml.safe_load(match.group(1))


def pins(requirements: str) -> dict[str, str]:
    lines = [line for line in requirements.splitlines() if line.strip() and not line.startswith("#")]
    assert all(re.fullmatch(r"[\w.-]+==[\w.+-]+", line) for line in lines), lines
    return dict(line.split("==") for line in lines)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# The folder ---------------------------------------------------------------------------------
def test_dry_run_writes_a_space_folder_and_uploads_nothing(hub, tmp_path, capsys):
    out = tmp_path / "space"
    assert main(["space", str(MODEL_DIR), "--repo-id", SPACE, "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert hub.commits == [] and hub.repos == {}
    assert f"{hub.url}/spaces/{SPACE}" in printed and "--dry-run" in printed

    written = files_of(out)
    assert written["app.py"] == SPACE_APP.encode()  # starts vit_hub.demo, as the checkout's app.py does
    for folder, target in (("vit_hub", "vit_hub"), ("export", "vit_hub/export")):  # as vit_hub.export imports
        for source in (ROOT / folder).rglob("*.py"):
            assert written[f"{target}/{source.relative_to(ROOT / folder).as_posix()}"] == source.read_bytes()
    assert not any(name.startswith("export/") for name in written)  # no top-level `export` package
    digits = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))  # the digit model's examples
    assert len(digits) == 10 and all(written[f"vit_hub/bundled/samples/{path.name}"] == path.read_bytes()
                                     for path in digits)
    for name in ("config.json", "model.safetensors", "model.onnx", "model_attentions.onnx", "faithfulness.json"):
        assert written[f"{MODEL_FOLDER}/{name}"] == (MODEL_DIR / name).read_bytes()
    assert not any(name.endswith((".pyc", ".gz")) for name in written)  # no caches, no training data

    front = front_matter(written["README.md"].decode())
    gradio_version = importlib.metadata.version("gradio")
    assert front["sdk"] == "gradio" and front["sdk_version"] == gradio_version and front["app_file"] == "app.py"
    assert front["title"] == "vit-mnist-demo" and front["license"] == "mit"  # the model card's licence
    assert "models" not in front  # a bundled model has no model repo to link
    assert front["tags"] == list(HUB_TAGS)  # the tags every vit_hub repo carries

    pinned = pins(written["requirements.txt"].decode())  # enough to run the app: the Space tests below
    assert set(pinned) == set(REQUIREMENTS) and not {"torch", "onnxruntime-gpu"} & set(pinned)
    assert pinned["gradio"] == gradio_version
    assert pinned["onnxruntime"] == importlib.metadata.version("onnxruntime-gpu")  # its CPU build
    for name in set(REQUIREMENTS) - {"onnxruntime"}:
        assert pinned[name] == importlib.metadata.version(name)
    assert "onnxruntime-gpu" in written["requirements.txt"].decode().split("\n\n")[0]  # the comment says why


def test_upload_creates_a_gradio_space_with_the_folder_in_one_commit(hub, tmp_path, capsys):
    out = tmp_path / "space"
    assert main(["space", str(MODEL_DIR), "--repo-id", SPACE, "--private", "--out", str(out)]) == 0
    [commit] = hub.commits
    space = hub.repos[SPACE]
    assert (space.kind, space.sdk, space.private) == ("space", "gradio", True)
    assert commit.files == files_of(out)
    assert capsys.readouterr().out.strip().endswith(f"uploaded: {hub.url}/spaces/{SPACE}")
    assert len(hub.validated_cards) == 1  # the Hub checked the README's front matter


def test_a_space_folder_is_replaced_but_no_other_folder(hub, tmp_path, capsys):
    out = tmp_path / "space"
    assert main(["space", str(MODEL_DIR), "--repo-id", SPACE, "--dry-run", "--out", str(out)]) == 0
    assert main(["space", str(MODEL_DIR), "--repo-id", SPACE, "--dry-run", "--out", str(out)]) == 0  # replaced
    (out / "stale.txt").write_text("a file vit-hub space did not write")  # tests/test_untrusted_space.py has more
    assert main(["space", str(MODEL_DIR), "--repo-id", SPACE, "--dry-run", "--out", str(out)]) == 2
    assert "'stale.txt' added or removed since" in one_line_error(capsys)
    assert (out / "stale.txt").exists()

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    assert main(["space", str(MODEL_DIR), "--repo-id", SPACE, "--dry-run", "--out", str(other)]) == 2
    assert "expected a new or empty folder" in one_line_error(capsys)
    assert (other / "todo.txt").read_text() == "mine"


def test_a_model_without_its_onnx_graphs_is_refused_naming_the_fix(hub, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(MODEL_DIR / name, bare / name)
    assert main(["space", str(bare), "--repo-id", SPACE, "--dry-run", "--out", str(tmp_path / "a")]) == 2
    assert "python -m vit_hub.export" in one_line_error(capsys)

    push_to_hub(bare, MODEL_REPO)  # weights only
    assert main(["space", MODEL_REPO, "--repo-id", SPACE, "--dry-run", "--out", str(tmp_path / "b")]) == 2
    assert "--with-onnx" in one_line_error(capsys)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_pulled_space_pins_the_model_repo_and_links_it(hub, tmp_path):
    push_to_hub(MODEL_DIR, MODEL_REPO, with_onnx=True)
    commit = hub.repos[MODEL_REPO].branches["main"].oid
    written = write_space(MODEL_REPO, tmp_path / "space", SPACE)
    assert (written.settings.model, written.settings.revision) == (MODEL_REPO, commit)
    assert not (written.folder / MODEL_FOLDER).exists()  # nothing bundled
    assert front_matter((written.folder / "README.md").read_text())["models"] == [MODEL_REPO]


@pytest.mark.parametrize("text, expected", [
    ('{"model": "../outside", "revision": null, "backend": "onnx"}', "expected the model folder inside the Space"),
    ('{"model": "model", "revision": null, "backend": "onnx", "extra": 1}', "expected {"),
    ('{"model": 7, "revision": null, "backend": "onnx"}', "expected {"),
    ('{"model": "model", "backend": "cuda"}', "expected {"),
    ("not json", "expected JSON"),
])
def test_space_settings_that_app_py_cannot_use_are_refused_in_one_line(tmp_path, text, expected):
    folder = tmp_path / "space"
    (folder / MODEL_FOLDER).mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (folder / SETTINGS_FILE).write_text(text)
    with pytest.raises(ValueError, match=re.escape(expected)) as refused:
        read_settings(folder)
    assert "\n" not in str(refused.value)


def test_space_settings_name_a_bundled_folder_or_a_pinned_repo(tmp_path):
    (tmp_path / MODEL_FOLDER).mkdir()
    (tmp_path / SETTINGS_FILE).write_text('{"model": "model", "revision": null, "backend": "onnx"}')
    assert Path(read_settings(tmp_path).model) == tmp_path / MODEL_FOLDER
    (tmp_path / SETTINGS_FILE).write_text(f'{{"model": "{MODEL_REPO}", "revision": "abc", "backend": "onnx"}}')
    assert (read_settings(tmp_path).model, read_settings(tmp_path).revision) == (MODEL_REPO, "abc")
    assert read_settings(tmp_path / MODEL_FOLDER) is None  # no space.json: app.py's own defaults


# The Space, started as the Hub starts it -------------------------------------------------------
@contextlib.contextmanager
def running_space(folder: Path, tmp_path: Path, **env: str):
    """`python app.py` in a copy of `folder`, with a Space's environment and no flags -> its URL.
    On exit the app is stopped and the copy must be exactly as it was written."""
    copy = tmp_path / "app"
    shutil.copytree(folder, copy)
    before = files_of(copy)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SPACE_PYTHON)
    home, temp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    temp.mkdir()
    port = free_port()
    space_env = {key: value for key, value in os.environ.items() if not key.startswith(("GRADIO_", "HF_"))}
    space_env.update(SPACE_REQUIREMENTS=" ".join(pins((folder / "requirements.txt").read_text())),
                     PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1",  # bytecode caches are Python's, not the app's
                     HOME=str(home), TMPDIR=str(temp), HF_HUB_DISABLE_TELEMETRY="1",
                     HF_ENDPOINT=f"http://127.0.0.1:{free_port()}",  # nowhere, unless a test gives its Hub
                     GRADIO_SERVER_NAME=SPACE_HOST, GRADIO_SERVER_PORT=str(port))
    space_env.update(env)
    log = tmp_path / "app.log"
    with open(log, "wb") as output:
        server = subprocess.Popen([sys.executable, "app.py"], cwd=copy, env=space_env, stdout=output,
                                  stderr=subprocess.STDOUT)
    url = f"http://{SPACE_HOST}:{port}/"
    try:
        wait_until_serving(server, url, log)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert files_of(copy) == before, "the app wrote into its own folder"


def wait_until_serving(server: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    from gradio_client import Client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"app.py exited with {server.returncode}:\n{log.read_text()[-3000:]}"
        try:
            Client(url, verbose=False)
            return
        except Exception:  # not listening yet
            time.sleep(1)
    raise AssertionError(f"app.py did not serve {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def classify(url: str) -> None:
    """The sample through the named endpoints: labels with the four pictures, labels with the
    map as numbers, and labels alone."""
    from gradio_client import Client, handle_file
    from PIL import Image

    client = Client(url, verbose=False)
    scores, overlay, strip, model_input, heads = client.predict(handle_file(str(SAMPLE)), "mean", 0.0, 3,
                                                                api_name="/explain")
    assert scores["label"] == "7" and len(scores["confidences"]) == 3
    assert Image.open(overlay).size == Image.open(model_input).size == (280, 280)
    numbers, answer = client.predict(handle_file(str(SAMPLE)), "mean", 0.0, 3, api_name="/predict")
    assert numbers == scores and len(answer["map"]) == answer["grid"][0]
    labels = client.predict(handle_file(str(SAMPLE)), 2, api_name="/predict_labels")
    assert labels["label"] == "7" and len(labels["confidences"]) == 2
    assert labels["confidences"][0]["confidence"] == pytest.approx(scores["confidences"][0]["confidence"])


@pytest.mark.slow
def test_bundled_space_starts_as_a_space_and_classifies(tmp_path):
    written = write_space(MODEL_DIR, tmp_path / "space", SPACE)
    with running_space(written.folder, tmp_path) as url:
        classify(url)


@pytest.mark.slow
def test_pulled_space_starts_on_its_pinned_commit_and_classifies(hub, tmp_path):
    push_to_hub(MODEL_DIR, MODEL_REPO, with_onnx=True)
    pinned = hub.repos[MODEL_REPO].branches["main"].oid
    written = write_space(MODEL_REPO, tmp_path / "space", SPACE)
    hub.put_file(MODEL_REPO, "model_attentions.onnx", b"a later push the Space must not pick up")
    written_at = len(hub.requests)
    with running_space(written.folder, tmp_path, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home")) as url:
        classify(url)
    fetched = [request for request in hub.requests[written_at:] if f"/{MODEL_REPO}/resolve/" in request]
    assert fetched and all(f"/resolve/{pinned}/" in request for request in fetched), fetched
    assert any(request.endswith("/model_attentions.onnx") for request in fetched)
