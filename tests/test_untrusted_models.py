"""Untrusted model dirs and Hub repos.

A model dir or a Hub repo is untrusted input exactly like an upload: a 1 KB config.json must
never be able to take the machine down. Every loader checks the config against the weights'
safetensors header before it allocates; memory cases run in a child process under an
RLIMIT_AS bound and assert its peak RSS, not only the error. Offline and deterministic: Hub
repos are served by tests/hub_double.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hub_double import serving_hub

from conftest import TINY_TRAIN_FLAGS, assert_one_line, free_port, run_app_main, tiny_config, write_class_folders
from vit_hub import cli
from vit_hub.demo import backends, methods
from vit_hub.hub.card import render_card_text
from vit_hub.hub.pretrained import HubVisionTransformer, load_model
from vit_hub.hub.repos import HubError, push_to_hub
from vit_hub.layout import ModelDir

REPO = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO / "models" / "vit-mnist"
SAMPLE = REPO / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
TOKEN = "hf_vitHubUntrustedToken0123456789abc"
HUB_REPO = "org/untrusted"
# What a refused load may add to the child's peak RSS, read from VmHWM (torch and vit_hub are
# imported before it is measured; what the CLI imports lazily is not: about 205 MB); the bundled
# model loads within it. Before the fix: 2.9 GB for embed_dim 6144.
RSS_BOUND_MB = 400
ADDRESS_SPACE_HEADROOM = 1 << 30  # RLIMIT_AS above what the child has mapped once imported: 1 GiB


# Helpers -------------------------------------------------------------------------------------



def run_vit_hub(*argv) -> tuple[int, str]:
    """`vit-hub ARGV` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main([str(arg) for arg in argv])
    return code, err.getvalue()





def error_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.startswith("error:"))


def listing(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def with_config(source: Path, folder: Path, **changes) -> Path:
    """A copy of the model dir `source` whose config.json has `changes` (None: the key removed)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps({key: value for key, value in config.items() if value is not None}))
    return folder


def with_weights(source: Path, folder: Path, change) -> Path:
    """A copy of the model dir `source` whose weights went through `change(tensors)`."""
    shutil.copytree(source, folder)
    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    change(tensors)
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"))
    return folder


def assert_refused_by_python_cli_and_app(model_dir: Path, message: str, loads=(load_model,)) -> None:
    """Each of `loads`, `vit-hub predict` and app.py refuse the model dir in one line with `message`."""
    for load in loads:
        with pytest.raises(ValueError) as error:
            load(model_dir)
        assert_one_line(str(error.value), message)
    code, stderr = run_vit_hub("predict", "--model", model_dir, SAMPLE)
    assert code == 2
    assert_one_line(stderr, message)
    assert_one_line(run_app_main("--model", model_dir, "--port", free_port()), "cannot load --model", message)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model dir (16x16 RGB, two blocks of width 16): about 19 KB of weights."""
    folder = tmp_path_factory.mktemp("untrusted") / "tiny"
    HubVisionTransformer(**tiny_config()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sincos_dir(tmp_path_factory) -> Path:
    """The tiny model with fixed sin-cos positions: no stored weight grows with the image size."""
    folder = tmp_path_factory.mktemp("untrusted") / "sincos"
    HubVisionTransformer(**tiny_config(pos_embedding="sincos")).save_pretrained(folder)
    return folder


# The config is checked against the weights before anything is allocated -------------------
CHILD = textwrap.dedent("""
    import contextlib, io, json, resource, sys

    from vit_hub import cli
    from vit_hub.hub.pretrained import HubVisionTransformer, load_model

    def vm_size():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    entry, model_dir, sample = sys.argv[1:4]
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + int(sys.argv[4]), hard))
    def peak_kb():  # VmHWM, not ru_maxrss: a child forked from pytest inherits its maxrss
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))

    before = peak_kb()
    error = ""
    try:
        if entry == "load_model":
            load_model(model_dir)
        elif entry == "from_pretrained":
            HubVisionTransformer.from_pretrained(model_dir)
        else:  # vit-hub ENTRY --model DIR ...
            argv = {"predict": ["predict", "--model", model_dir, sample], "info": ["info", "--model", model_dir]}
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                code = cli.main(argv[entry])
            error = err.getvalue().strip().removeprefix("error: ") if code else ""
    except BaseException as caught:
        error = f"{type(caught).__name__}: {caught}"
    grown = (peak_kb() - before) / 1024
    print(json.dumps({"error": error, "grown_mb": grown}))
""")


def load_in_child(entry: str, model_dir: Path) -> dict:
    """Run `entry` on `model_dir` in a fresh process under RLIMIT_AS: {"error", "grown_mb"}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", CHILD, entry, str(model_dir), str(SAMPLE),
                             str(ADDRESS_SPACE_HEADROOM)], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


HOSTILE_CONFIGS = {  # config.json changes -> the one line that refuses them
    "embed_dim 6144 beside 19 KB": (dict(embed_dim=6144), "do not match the config: expected cls_token of shape "
                                    "[1, 1, 6144], found [1, 1, 16] (and 30 more of another shape)"),
    "depth 100000": (dict(depth=100_000), "depth: expected an int from 1 to 512, found 100000"),
    "depth 10^9": (dict(depth=10**9), "depth: expected an int from 1 to 512, found 1000000000"),
    "num_classes 10^7": (dict(num_classes=10**7, labels=None), "num_classes: expected an int from 0 to 100,000, "
                         "found 10000000"),
    "embed_dim 10^6": (dict(embed_dim=10**6), "embed_dim: expected an int from 1 to 16,384, found 1000000"),
    "image_size 10^6": (dict(image_size=10**6), "image_size: expected sides from 1 to 4,096, found 1000000"),
}


@pytest.mark.parametrize("case", HOSTILE_CONFIGS)
def test_an_absurd_config_is_refused_in_one_line_within_a_memory_bound(model_dir, tmp_path, case):
    """`vit-hub predict` (through load_model) in a fresh process under RLIMIT_AS."""
    changes, message = HOSTILE_CONFIGS[case]
    outcome = load_in_child("predict", with_config(model_dir, tmp_path / "hostile", **changes))
    assert_one_line(outcome["error"], message)
    assert outcome["grown_mb"] < RSS_BOUND_MB, outcome


def test_attention_maps_absurd_for_the_weights_are_refused_within_a_memory_bound(sincos_dir, tmp_path):
    """Sin-cos positions store nothing that grows with the image: 64x64 patches of a 19 KB model
    would ask 256 MiB of attention maps per image, and only the weights' size can tell."""
    hostile = with_config(sincos_dir, tmp_path / "hostile", image_size=256)
    outcome = load_in_child("from_pretrained", hostile)
    assert_one_line(outcome["error"], "expected a config whose attention maps for one image fit 128 MiB",
                    "found 4,097 tokens")
    assert outcome["grown_mb"] < RSS_BOUND_MB, outcome
    assert load_model(with_config(sincos_dir, tmp_path / "larger", image_size=64)).config.num_patches == 256


def test_the_bundled_model_loads_within_the_same_bound():
    outcome = load_in_child("info", BUNDLED_MODEL)
    assert outcome["error"] == "" and outcome["grown_mb"] < RSS_BOUND_MB, outcome


@pytest.mark.slow
def test_every_entry_point_refuses_a_config_that_does_not_fit_the_weights(model_dir, tmp_path):
    """eval, inspect, info, export and the app load through the same checks."""
    from vit_hub.export.__main__ import main as export_main

    hostile = with_config(model_dir, tmp_path / "hostile", embed_dim=32)
    fragment = "do not match the config: expected cls_token of shape [1, 1, 32], found [1, 1, 16]"
    for argv in (["eval", "--model", hostile, "--data", tmp_path / "data"],
                 ["inspect", "--model", hostile, "--out", tmp_path / "inspect"], ["info", "--model", hostile]):
        code, stderr = run_vit_hub(*argv)
        assert code == 2
        assert_one_line(stderr, fragment)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert export_main(["--model", str(hostile), "--out", str(tmp_path / "onnx")]) == 2
    assert_one_line(err.getvalue(), fragment)
    assert_one_line(run_app_main("--model", hostile, "--port", free_port()), "cannot load --model", fragment)
    assert not (tmp_path / "onnx").exists()


@pytest.fixture
def never_built(monkeypatch):
    """Building a model fails the test: weights must be checked before any model exists."""
    def built(*args, **kwargs):
        raise AssertionError("the model was built before its weights were checked")

    monkeypatch.setattr(HubVisionTransformer, "__init__", built)


@pytest.mark.parametrize("change, fragment", [
    (lambda tensors: tensors.pop("head.bias"), "found missing ['head.bias'], unexpected []"),
    (lambda tensors: tensors.update(extra=torch.zeros(3)), "found missing [], unexpected ['extra']"),
    (lambda tensors: tensors.update({"head.weight": torch.zeros(5, 16)}),
     "expected head.weight of shape [2, 16], found [5, 16]"),
], ids=["missing", "unexpected", "other-shape"])
def test_weights_that_do_not_fit_the_config_are_refused_before_the_model_is_built(model_dir, tmp_path,
                                                                                   never_built, change, fragment):
    hostile = with_weights(model_dir, tmp_path / "hostile", change)
    with pytest.raises(ValueError) as error:
        load_model(hostile)
    assert_one_line(str(error.value), "do not match the config", fragment)


def test_a_safetensors_header_over_16_mib_is_refused_before_it_is_parsed(model_dir, tmp_path):
    """safetensors itself parses headers up to 100 MB; JSON may be padded with spaces."""
    hostile = with_weights(model_dir, tmp_path / "hostile", lambda tensors: None)
    weights = hostile / "model.safetensors"
    data = weights.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + length] + b" " * (17 * 2**20)
    weights.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length:])
    with pytest.raises(ValueError) as error:
        load_model(hostile)
    assert_one_line(str(error.value), "expected a safetensors header of at most 16 MiB", "found one of 17,")


# Non-finite weights ----------------------------------------------------------------------
@pytest.mark.parametrize("value, found", [(float("nan"), "NaN"), (float("inf"), "an infinity")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(model_dir, tmp_path, value, found):
    def poison(tensors):
        tensors["blocks.1.mlp.fc1.weight"][3, 2] = value

    hostile = with_weights(model_dir, tmp_path / "hostile", poison)
    assert_refused_by_python_cli_and_app(hostile, f"expected finite numbers, found {found} in blocks.1.mlp.fc1.weight")


# Every config field type-checked; faithfulness.json ------------------------------------------
def deeply_nested(depth: int) -> str:
    return '{"embed_dim": 16, "patch_size": 4, "labels": ' + "[" * depth + "]" * depth + "}"


CONFIG_TYPE_CASES = {
    "labels: 5": (dict(labels=5), "labels: expected a list of strings or null, found 5"),
    'layer_norm_eps: "x"': (dict(layer_norm_eps="x"), "layer_norm_eps: expected a number, found 'x'"),
    'qkv_bias: "no"': (dict(qkv_bias="no"), "qkv_bias: expected true or false, found 'no'"),
    "mean: {}": (dict(mean={}), "mean: expected a number, a list of numbers or null, found {}"),
    "embed_dim 10^6": (dict(embed_dim=10**6), "embed_dim: expected an int from 1 to 16,384, found 1000000"),
    "nested 100k deep": (None, "expected JSON nested a few levels deep, found nesting too deep to parse"),
}


@pytest.mark.parametrize("case", CONFIG_TYPE_CASES)
def test_a_config_field_of_the_wrong_type_is_one_line_everywhere(model_dir, tmp_path, case):
    changes, message = CONFIG_TYPE_CASES[case]
    if changes is None:
        hostile = with_config(model_dir, tmp_path / "hostile")
        (hostile / "config.json").write_text(deeply_nested(100_000))
    else:
        hostile = with_config(model_dir, tmp_path / "hostile", **changes)
    assert_refused_by_python_cli_and_app(hostile, message,
                                         (load_model, lambda folder: HubVisionTransformer.from_pretrained(str(folder))))


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"images": 10, "methods": {"rollout": {"deletion_auc": "0.1", "insertion_auc": 0.8}}}),
    json.dumps({"methods": ["rollout"]}),
], ids=["not-json", "string-auc", "methods-not-an-object"])
def test_a_faithfulness_json_the_page_cannot_use_falls_back_to_the_default_with_a_warning(tmp_path, content):
    shutil.copytree(BUNDLED_MODEL, tmp_path / "model", ignore=shutil.ignore_patterns("*.onnx", "*.png"))
    (tmp_path / "model" / ModelDir.faithfulness).write_text(content)
    predictor = backends.TorchPredictor.load(tmp_path / "model")
    with pytest.warns(UserWarning, match="faithfulness.json not used, the page opens with the default method"):
        assert methods.opening_method(predictor) == methods.DEFAULT_METHOD
    with pytest.warns(UserWarning):
        assert "was not measured for this model" in methods.faithfulness_table(predictor.model_dir, predictor.methods)


# The model card escapes labels and folder names ------------------------------------------------
HOSTILE_LABELS = ["<img src=x onerror=alert(1)>", "a|b", "line break", "[link](javascript:alert(1))"]


def card_prose(card: str) -> str:
    """The Markdown a card renders: without its YAML metadata (data, not Markdown), its fenced
    code blocks (shown as written) and its seal (an HTML comment of ours)."""
    body = card.split("\n---\n", 1)[1]
    prose = re.sub(r"^(`{3,})[^\n]*\n.*?^\1$", "", body, flags=re.DOTALL | re.MULTILINE)
    return prose.rpartition("<!-- vit_hub card sha256:")[0]


def assert_card_escapes(card: str) -> None:
    prose = card_prose(card)
    assert "<img" not in prose and "<b>" not in prose and "[link](javascript:" not in prose, prose
    table = [line for line in prose.splitlines() if line.startswith("|")]
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 3 for line in table), table  # two cells a row, whatever the labels
    classes = next(line for line in table if line.startswith("| classes |"))
    assert "&lt;img src=x onerror=alert(1)&gt;" in classes and r"a\|b" in classes and "line break" in classes
    assert r"\[link\](javascript:alert(1))" in classes  # shown as text, not a link


def test_hostile_labels_and_folder_names_are_escaped_in_the_model_card(tmp_path):
    folder = tmp_path / "<b>model|name"
    HubVisionTransformer(**tiny_config(labels=HOSTILE_LABELS)).save_pretrained(folder)
    assert_card_escapes(render_card_text(folder))
    assert "# &lt;b&gt;model\\|name" in render_card_text(folder)


@pytest.mark.slow
def test_class_folders_named_with_html_train_into_an_escaped_card(tmp_path):
    """The labels of a trained model are its class-folder names."""
    data = tmp_path / "data"
    write_class_folders(data, per_class=6, seed=0)
    for old, new in zip(sorted(path.name for path in data.iterdir()), ["<img src=x onerror=alert(1)>", "a|b c"]):
        (data / old).rename(data / new)
    code, stderr = run_vit_hub("train", "--data", data, "--out", tmp_path / "out", "--epochs", "1", *TINY_TRAIN_FLAGS)
    assert code == 0, stderr
    card = (tmp_path / "out" / "README.md").read_text()
    prose = card_prose(card)
    assert "<img" not in prose and "&lt;img src=x onerror=alert(1)&gt;" in prose and r"a\|b c" in prose


def test_a_class_folder_named_with_a_newline_is_refused_before_training(tmp_path):
    data = tmp_path / "data"
    write_class_folders(data, per_class=2, seed=0)
    (data / sorted(path.name for path in data.iterdir())[0]).rename(data / "cat\nx.png: dog 1.000")
    code, stderr = run_vit_hub("train", "--data", data, "--out", tmp_path / "out", "--epochs", "1", *TINY_TRAIN_FLAGS)
    assert code == 2
    assert_one_line(stderr, "labels: expected names without control characters", r"'cat\nx.png: dog 1.000'")
    assert not (tmp_path / "out" / "model.safetensors").exists()


# Temperatures and labels a fit or a person would not write --------------------------------
@pytest.mark.parametrize("temperature", [1e-45, 1e-320, 1e308, 0.01, 25.0])
def test_a_temperature_no_fit_gives_is_refused_everywhere(model_dir, tmp_path, temperature):
    """1e-45 divides the logits into infinities (NaN probabilities), 1e308 makes every class
    alike; predict, the app and export (through load_model) refuse either in one line."""
    refused = with_config(model_dir, tmp_path / "model", temperature=temperature)
    assert_refused_by_python_cli_and_app(refused, f"temperature: expected a number from 0.05 to 20.0 (what a fit "
                                                  f"on the validation split gives), got {temperature}")


@pytest.mark.parametrize("labels, found", [
    (["7\n/tmp/other.png: 9 1.000", "1"], r"'7\n/tmp/other.png: 9 1.000'"),
    (["\x1b[31mred", "1"], r"'\x1b[31mred'"),
    (["right\u202eto left", "1"], r"'right\u202eto left'"),
], ids=["newline", "terminal-escape", "bidi-override"])
def test_a_label_with_control_characters_is_refused_where_the_config_is_read(model_dir, tmp_path, labels, found):
    """Such a label would forge a line of `vit-hub predict` (a newline) or steer the terminal."""
    refused = with_config(model_dir, tmp_path / "model", labels=labels)
    assert_refused_by_python_cli_and_app(refused, "labels: expected names without control characters (newlines, "
                                                  f"terminal escapes), found {found}")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029"], ids=["line-separator", "paragraph-separator"])
def test_unicodes_line_and_paragraph_separators_are_control_characters(separator):
    """U+2028 and U+2029 end a line in many terminals and viewers as a newline does: a label
    holding one is refused, and printed text shows it as its escape."""
    from vit_hub.console import escaped, is_control
    from vit_hub.model.config import ViTConfig
    from vit_hub.model.fields import ConfigError

    assert is_control(separator)
    assert escaped(f"7{separator}forged") == f"7\\u{ord(separator):04x}forged"
    with pytest.raises(ConfigError) as refused:
        ViTConfig(**tiny_config(labels=[f"7{separator}/tmp/other.png: 9 1.000", "1"]))
    assert_one_line(str(refused.value), "labels: expected names without control characters",
                    f"'7\\u{ord(separator):04x}/tmp/other.png: 9 1.000'")


@pytest.mark.parametrize("temperature", [0.05, 20.0])
def test_the_temperatures_at_the_ends_of_the_fitted_range_are_accepted(model_dir, tmp_path, temperature):
    """A fit may give either end of TEMPERATURE_RANGE (0.05, 20.0): the config takes it and the
    model loads and predicts at it."""
    from vit_hub.model.config import TEMPERATURE_RANGE

    assert temperature in TEMPERATURE_RANGE
    model = load_model(with_config(model_dir, tmp_path / "model", temperature=temperature))
    assert model.config.temperature == temperature
    code, stderr = run_vit_hub("predict", "--model", tmp_path / "model", SAMPLE)
    assert code == 0, stderr


@pytest.mark.parametrize("labels", [["7", "7 "], ["caf\u00e9", "cafe\u0301"], ["\ufb01sh", "fish"]],
                         ids=["trailing-space", "nfc", "nfkc"])
def test_labels_that_read_alike_are_refused(model_dir, tmp_path, labels):
    refused = with_config(model_dir, tmp_path / "model", labels=labels)
    assert_refused_by_python_cli_and_app(refused, f"labels: expected a different name for each class, found "
                                                  f"{sorted(labels)!r} more than once")


def test_predict_prints_each_image_on_one_line(model_dir, tmp_path):
    """What `vit-hub predict` prints of a path (a file name may hold a newline) is escaped too."""
    image = tmp_path / "a\nforged.png"
    shutil.copyfile(SAMPLE, image)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["predict", "--model", str(model_dir), str(image)]) == 0
    assert out.getvalue().count("\n") == 1 and out.getvalue().startswith(str(image).replace("\n", "\\n"))


# Push never follows a link out; pull never leaves a mixed dir ---------------------------
@pytest.fixture
def hub(monkeypatch, tmp_path):
    with serving_hub(monkeypatch, tmp_path / "hf-cache", TOKEN) as double:
        yield double


@pytest.mark.parametrize("name", ["curves.png", "README.md"])
def test_push_refuses_a_file_linked_out_of_the_model_dir(hub, model_dir, tmp_path, name):
    secret = tmp_path / "secret.txt"
    secret.write_text("server secret: never uploaded")
    folder = shutil.copytree(model_dir, tmp_path / "model")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secret)
    code, stderr = run_vit_hub("push", "--model", folder, "--repo-id", HUB_REPO)
    assert code == 2
    assert_one_line(stderr, f"push --model: expected regular files inside {folder}, found {name}, a link leading out")
    with pytest.raises(HubError):
        push_to_hub(folder, HUB_REPO)
    assert hub.commits == [] and "secret" not in stderr


def test_push_refuses_weights_linked_out_of_the_model_dir_even_when_they_fit_the_config(hub, model_dir, tmp_path):
    """model.safetensors linked to another model's weights (same shapes, valid safetensors): every
    check of the file itself passes, so only the link check stands between them and the Hub."""
    private = tmp_path / "private" / "model.safetensors"
    HubVisionTransformer(**tiny_config()).save_pretrained(private.parent)
    folder = shutil.copytree(model_dir, tmp_path / "model")
    (folder / ModelDir.weights).unlink()
    (folder / ModelDir.weights).symlink_to(private)
    code, stderr = run_vit_hub("push", "--model", folder, "--repo-id", HUB_REPO)
    assert code == 2
    assert_one_line(stderr, f"found {ModelDir.weights}, a link leading out")
    with pytest.raises(HubError, match="a link leading out"):
        push_to_hub(folder, HUB_REPO)
    assert hub.commits == []


def test_push_follows_a_link_that_stays_inside_the_model_dir(hub, model_dir, tmp_path):
    folder = shutil.copytree(model_dir, tmp_path / "model")
    (folder / "plots").mkdir()
    (folder / "plots" / "curves.png").write_bytes(b"\x89PNG curves")
    (folder / "curves.png").symlink_to(Path("plots") / "curves.png")
    push_to_hub(folder, HUB_REPO)
    assert hub.files(HUB_REPO)["curves.png"] == b"\x89PNG curves"


@pytest.fixture
def pushed(hub, model_dir) -> str:
    push_to_hub(model_dir, HUB_REPO)
    return HUB_REPO


def test_pull_into_a_non_empty_folder_refuses_unless_overwrite_then_replaces_it_whole(hub, pushed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"local": "edit"}')
    (out / "notes.txt").write_text("a local file the repo lacks")
    before = listing(out)
    code, stderr = run_vit_hub("pull", pushed, "--out", out)
    assert code == 2
    assert_one_line(stderr, f"--out {out}: expected a new or empty folder, found config.json, notes.txt", "--overwrite")
    assert listing(out) == before

    assert run_vit_hub("pull", pushed, "--out", out, "--overwrite")[0] == 0
    pulled = {name: data for name, data in listing(out).items() if not name.startswith(".cache")}
    assert pulled == hub.files(pushed)  # the repo's files, and nothing of the folder before
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".out")]  # no staging left
    load_model(out)


@pytest.mark.parametrize("changes, fragment", [
    (dict(depth=10**9), "depth: expected an int from 1 to 512, found 1000000000"),
    (dict(embed_dim=6144), f"weights in {HUB_REPO}'s model.safetensors do not match the config: expected "
                           "cls_token of shape [1, 1, 6144]"),
], ids=["depth-10^9", "embed_dim-6144"])
def test_pull_refuses_a_repo_whose_config_does_not_fit_and_leaves_the_folder_as_it_was(hub, pushed, tmp_path,
                                                                                       changes, fragment):
    config = json.loads(hub.files(pushed)["config.json"])
    hub.put_file(pushed, "config.json", json.dumps({**config, **changes}).encode())
    for overwrite in ([], ["--overwrite"]):
        out = tmp_path / f"out{len(overwrite)}"
        if overwrite:
            out.mkdir()
            (out / "kept.txt").write_text("the folder before")
        before = listing(out) if out.exists() else None
        code, stderr = run_vit_hub("pull", pushed, "--out", out, *overwrite)
        assert code == 2
        assert_one_line(error_lines(stderr), fragment)  # after huggingface_hub's progress bar
        assert (listing(out) if out.exists() else None) == before
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".out")]  # no staging left


# Import: the converted weights are checked before the model is built -------------------------------------
@pytest.fixture(scope="module")
def transformers_dir(tmp_path_factory) -> Path:
    """A small transformers ViTForImageClassification: width 16, two layers, MLP 32, 16 px."""
    import transformers

    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                    image_size=16, patch_size=4, num_labels=2)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("transformers") / "vit"
    transformers.ViTForImageClassification(config).save_pretrained(folder, safe_serialization=True)
    return folder


def without_layer_zero(tensors):
    for name in [name for name in tensors if name.startswith("vit.encoder.layer.0.")]:
        tensors.pop(name)


def wider_second_mlp(tensors):
    tensors["vit.encoder.layer.1.intermediate.dense.weight"] = torch.zeros(24, 16)
    tensors["vit.encoder.layer.1.intermediate.dense.bias"] = torch.zeros(24)
    tensors["vit.encoder.layer.1.output.dense.weight"] = torch.zeros(16, 24)


def nan_position(tensors):
    tensors["vit.embeddings.position_embeddings"][0, 3, 1] = float("nan")


@pytest.mark.parametrize("change, fragment", [
    (without_layer_zero, "expected 'encoder.layer.0."),  # a KeyError's traceback before
    (wider_second_mlp, "the converted weights do not match the config: expected blocks.1.mlp.fc1.weight of shape "
                       "[32, 16], found [24, 16]"),
    (nan_position, "the converted weights: expected finite numbers, found NaN in pos_embedding"),
], ids=["layer-missing", "inconsistent-layers", "nan"])
def test_import_refuses_weights_that_do_not_make_the_model_in_one_line(transformers_dir, tmp_path, never_built,
                                                                       change, fragment):
    source = with_weights(transformers_dir, tmp_path / "source", change)
    code, stderr = run_vit_hub("import", source, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line(stderr, fragment)
    assert not (tmp_path / "out").exists()
