"""`vit-hub space` with untrusted folders: it replaces only a folder it wrote and that nobody
changed since, never one that merely holds a space.json, never a folder holding the model, never
through a link; a model the Space's app would refuse at start (a file linked out of the folder,
a graph with a custom operator) is refused when the Space is written; a sparse multi-gigabyte
README.md and a space.json nested 30,000 deep are refused in one line before they cost memory."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from hub_double import serving_hub
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data
from PIL import Image

from conftest import assert_one_line
from vit_hub.cli import main
from vit_hub.data.samples import kept_samples
from vit_hub.errors import UserError
from vit_hub.export.graph_check import WEIGHTS_SHA256, weights_sha256
from vit_hub.hub import space as space_module
from vit_hub.hub.import_model import SourceFiles, source_license
from vit_hub.hub.repos import push_to_hub
from vit_hub.hub.space import MARKER_FILE, SETTINGS_FILE, read_settings
from vit_hub.hub.static_space import ORT_WEB_VERSION
from vit_hub.storage import MAX_CARD_BYTES

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = ROOT / "models" / "vit-mnist"
SPACE = "me/vit-mnist-demo"
TOKEN = "hf_vitHubSpaceTestToken0123456789abcdef"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with serving_hub(monkeypatch, tmp_path / "hf-cache", TOKEN) as double:
        yield double


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return shutil.copytree(BUNDLED_MODEL, tmp_path / "model")


def space(model: Path | str, out: Path) -> tuple[int, str]:
    """`vit-hub space MODEL --dry-run --out OUT` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["space", str(model), "--repo-id", SPACE, "--dry-run", "--out", str(out)])
    return code, err.getvalue()


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def sparse_file(path: Path, size: int) -> Path:
    """A file that claims `size` bytes and takes none on disk."""
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


# Which folder may be replaced ----------------------------------------------------------------
@pytest.mark.parametrize("settings", ["", '{"model": "model", "revision": null, "backend": "onnx"}'])
def test_a_folder_holding_a_space_json_among_user_files_is_never_replaced(hub, model_dir, tmp_path, settings):
    home = tmp_path / "home"
    (home / "projects" / "thesis").mkdir(parents=True)
    (home / "projects" / "thesis" / "chapter1.tex").write_text("months of work")
    (home / "notes.txt").write_text("mine")
    (home / SETTINGS_FILE).write_text(settings)
    before = files_of(home)
    code, stderr = space(model_dir, home)
    assert code == 2
    assert_one_line(stderr, "expected a new or empty folder", f"no {MARKER_FILE} written by vit-hub space")
    assert files_of(home) == before


def test_a_space_folder_is_replaced_only_while_unchanged(hub, model_dir, tmp_path):
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    written = files_of(out)
    assert MARKER_FILE in written and not list(tmp_path.glob(".space.*"))  # no staging folder left
    assert space(model_dir, out)[0] == 0  # as written: replaced
    assert files_of(out) == written

    (out / "notes.txt").write_text("added by hand")
    code, stderr = space(model_dir, out)
    assert code == 2 and "'notes.txt' added or removed since" in assert_one_line(stderr)
    assert (out / "notes.txt").read_text() == "added by hand"
    (out / "notes.txt").unlink()
    (out / "app.py").write_text("edited by hand")
    code, stderr = space(model_dir, out)
    assert code == 2 and "'app.py' changed since it was written" in assert_one_line(stderr)
    assert (out / "app.py").read_text() == "edited by hand"


def test_a_space_folder_missing_a_file_it_lists_is_refused(hub, model_dir, tmp_path):
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    (out / "requirements.txt").unlink()
    before = files_of(out)
    code, stderr = space(model_dir, out)
    assert code == 2 and "'requirements.txt' added or removed since" in assert_one_line(stderr)
    assert files_of(out) == before


def space_printing(model: Path | str, out: Path | str) -> tuple[int, str]:
    """`vit-hub space MODEL --dry-run --out OUT` in this process: (exit code, stdout)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["space", str(model), "--repo-id", SPACE, "--dry-run", "--out", str(out)])
    return code, printed.getvalue()


def backups(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.replaced-*"))


def test_files_added_or_edited_behind_a_re_hashed_marker_are_kept_in_a_backup(hub, model_dir, tmp_path):
    """A person who adds notes.txt and rewrites app.py, then re-hashes the marker, passes the
    check; the new Space replaces the folder, and the old one stays beside it, named."""
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    (out / "notes.txt").write_text("added by hand")
    (out / "app.py").write_text("edited by hand")
    listed = [line.partition("  ")[2] for line in (out / MARKER_FILE).read_text().splitlines()]
    (out / MARKER_FILE).write_text(space_module._manifest(out, [*listed, "notes.txt"]))
    code, printed = space_printing(model_dir, out)
    assert code == 0
    [backup] = backups(tmp_path)
    assert f"kept the folder it replaced as {backup}" in printed
    assert (backup / "notes.txt").read_text() == "added by hand" and (backup / "app.py").read_text() == "edited by hand"
    assert not (out / "notes.txt").exists() and (out / "app.py").read_text() != "edited by hand"
    assert space(model_dir, out)[0] == 0 and backups(tmp_path) == [backup]  # unchanged: replaced, nothing kept


def test_a_file_written_between_the_check_and_the_swap_is_kept(hub, model_dir, tmp_path, monkeypatch):
    """While the new Space is written beside it, a person writes notes.txt into the folder and
    edits app.py: both are in the backup the swap keeps."""
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    manifest = space_module._manifest

    def meanwhile(folder, files):  # runs in the new folder, after the check of `out`, before the swap
        (out / "notes.txt").write_text("written meanwhile")
        (out / "app.py").write_text("edited meanwhile")
        return manifest(folder, files)

    monkeypatch.setattr(space_module, "_manifest", meanwhile)
    assert space(model_dir, out)[0] == 0
    [backup] = backups(tmp_path)
    assert (backup / "notes.txt").read_text() == "written meanwhile"
    assert (backup / "app.py").read_text() == "edited meanwhile"


def write_a_space(out: Path, files: dict[str, str]) -> space_module.WrittenSpace:
    """space.write_folder of text files, as `vit-hub space` writes its folder (marker included)."""
    return space_module.write_folder(out, {}, files, space_module.SpaceSettings("model", None))


def test_a_replaced_folder_is_deleted_only_when_the_new_one_holds_all_of_it(tmp_path):
    """The backup check asks whether the new Space holds the old folder, not the other way round:
    a person's notes.txt beside a Space the new one repeats file for file keeps the old folder;
    without it, the old folder goes."""
    out = tmp_path / "space"
    write_a_space(out, {"app.py": "the app"})
    (out / "notes.txt").write_text("a person's notes")
    written = write_a_space(out, {"app.py": "the app"})
    assert written.backup is not None and backups(tmp_path) == [written.backup]
    assert (written.backup / "notes.txt").read_text() == "a person's notes"
    assert (out / "app.py").read_text() == "the app" and not (out / "notes.txt").exists()
    shutil.rmtree(written.backup)
    assert write_a_space(out, {"app.py": "the app"}).backup is None and backups(tmp_path) == []  # nothing of a person's


def test_a_persons_empty_folder_keeps_the_replaced_folder(tmp_path):
    """An empty folder a person made in the Space (drafts/) is not in the new one: the old folder
    is kept as a backup, the empty folder in it."""
    out = tmp_path / "space"
    write_a_space(out, {"app.py": "the app"})
    (out / "drafts").mkdir()
    written = write_a_space(out, {"app.py": "the app"})
    assert written.backup is not None and (written.backup / "drafts").is_dir()
    assert not (out / "drafts").exists()


def test_a_failed_swap_leaves_the_folder_it_was_replacing_in_place(tmp_path, monkeypatch):
    """When moving the new Space to --out fails (the old one already moved aside), the old one is
    moved back: --out holds what it held, and the error is raised."""
    out = tmp_path / "space"
    write_a_space(out, {"app.py": "the old app"})
    (out / "notes.txt").write_text("a person's notes")
    before = files_of(out)
    rename = os.rename

    def failing_rename(source, target, *args, **kwargs):
        if Path(target) == out and ".writing-" in Path(source).name:  # the new Space into --out
            raise OSError(errno.EBUSY, "device or resource busy", str(target))
        return rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="busy"):
        write_a_space(out, {"app.py": "the new app"})
    monkeypatch.undo()
    assert files_of(out) == before
    assert backups(tmp_path) == []


def test_out_dot_from_inside_the_space_folder_replaces_it(hub, model_dir, tmp_path, monkeypatch):
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    written = files_of(out)
    monkeypatch.chdir(out)
    code, stderr = space(model_dir, ".")
    assert code == 0, stderr
    assert files_of(out) == written and sorted(path.name for path in tmp_path.iterdir()) == ["model", "space"]


def test_the_model_inside_the_space_folder_is_never_deleted(hub, model_dir, tmp_path):
    out = tmp_path / "space"
    assert space(model_dir, out)[0] == 0
    model_inside = out / "model"
    before = files_of(model_inside)
    code, stderr = space(model_inside, out)
    assert code == 2
    assert_one_line(stderr, "expected a folder apart from the model")
    assert files_of(model_inside) == before
    nested = shutil.copytree(model_dir, tmp_path / "empty" / "inner")  # a model in a folder of no Space
    assert space(nested, tmp_path / "empty")[0] == 2 and files_of(nested) == files_of(model_dir)


def test_an_out_that_is_a_link_is_refused_in_one_line(hub, model_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(target)
    code, stderr = space(model_dir, tmp_path / "link")
    assert code == 2
    assert_one_line(stderr, "--out: expected a folder", "a link")
    assert files_of(target) == {"keep.txt": b"mine"} and (tmp_path / "link").is_symlink()


# What the Space's app would refuse at start ---------------------------------------------------
@pytest.mark.parametrize("name", ["model.onnx", "config.json", "model.safetensors", "model_attentions.onnx"])
def test_a_model_file_linked_out_of_the_folder_is_refused(hub, model_dir, tmp_path, name):
    outside = shutil.copy(model_dir / name, tmp_path / f"outside-{name}")
    (model_dir / name).unlink()
    (model_dir / name).symlink_to(outside)
    code, stderr = space(model_dir, tmp_path / "space")
    assert code == 2
    assert_one_line(stderr, f"expected regular files inside {model_dir}, found {name}, a link leading out")
    assert not (tmp_path / "space").exists()


def test_a_graph_with_a_custom_operator_is_refused_when_the_space_is_written(hub, model_dir, tmp_path):
    node = helper.make_node("FusedGelu", ["pixel_values"], ["logits"], domain="com.example")
    graph = helper.make_graph([node], "custom", [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT,
                                                                              ["batch", 1, 28, 28])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    (model_dir / "model.onnx").write_bytes(model.SerializeToString())
    code, stderr = space(model_dir, tmp_path / "space")
    assert code == 2
    assert_one_line(stderr, "expected only the operators python -m vit_hub.export writes", "com.example.FusedGelu")
    assert not (tmp_path / "space").exists()


# Files that claim gigabytes ------------------------------------------------------------------
def test_a_sparse_3_gb_model_card_is_refused_by_space_push_and_import_in_one_line(hub, model_dir, tmp_path):
    sparse_file(model_dir / "README.md", 3 * 2**30)
    expected = f"expected a model card of at most {MAX_CARD_BYTES // 2**20} MiB, found a larger one"
    code, stderr = space(model_dir, tmp_path / "space")
    assert code == 2 and expected in assert_one_line(stderr)
    with pytest.raises(UserError, match=expected):
        push_to_hub(model_dir, "me/vit-mnist")
    with pytest.raises(UserError, match=expected):
        source_license(SourceFiles("me/timm-vit", model_dir, {"pretrained_cfg": {}}, hub=False))
    assert hub.commits == []


def test_a_space_json_nested_30000_deep_is_refused_in_one_line(tmp_path):
    (tmp_path / SETTINGS_FILE).write_text("[" * 30_000)
    with pytest.raises(UserError) as refused:
        read_settings(tmp_path)
    assert_one_line(str(refused.value), "expected JSON nested a few levels deep")


# What the static Space bundles: pipeline.onnx and the samples ---------------------------------
ORT_WEB = ROOT / ".venv" / "cache" / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"


def static_space(model: Path, out: Path) -> tuple[int, str]:
    """`vit-hub space MODEL --static --dry-run --out OUT` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["space", str(model), "--static", "--repo-id", SPACE, "--dry-run", "--out", str(out),
                     "--onnxruntime-web", str(ORT_WEB)])
    return code, err.getvalue()


def tied(model: onnx.ModelProto, weights: Path) -> bytes:
    """The graph's bytes, carrying the sha256 of `weights` as an export writes it."""
    del model.metadata_props[:]
    helper.set_model_props(model, {WEIGHTS_SHA256: weights_sha256(weights)})
    return model.SerializeToString()


def graph_of(nodes, initializers, weights: Path, opset: int = 18) -> bytes:
    """A pipeline-shaped graph (`image` uint8 in, `probabilities` float32 [10] out) of `nodes`."""
    graph = helper.make_graph(nodes, "hostile", [helper.make_tensor_value_info("image", TensorProto.UINT8,
                                                                               ["height", "width", "channels"])],
                              [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [10])], initializers)
    return tied(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9), weights)


def with_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    for entry in model.opset_import:
        entry.version = version
    return model


def with_custom_node(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.node.insert(0, helper.make_node("Decode", ["image"], ["unused"], domain="com.example"))
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


ZEROS = numpy_helper.from_array(np.zeros(10, np.float32), "zeros")
HUGE = numpy_helper.from_array(np.array([2**31], np.int64), "huge")
BAD_PIPELINES = {  # name: (the bytes of pipeline.onnx from (the model's graph, its weights), what the refusal says)
    "empty": (lambda graph, weights: b"", "expected an ONNX model onnxruntime can load, found one it cannot (no graph"),
    "random-bytes": (lambda graph, weights: np.random.default_rng(0).bytes(4096), "expected an ONNX model"),
    "custom-op": (lambda graph, weights: tied(with_custom_node(graph), weights), "found com.example.Decode"),
    "opset-99": (lambda graph, weights: tied(with_opset(graph, 99), weights), "expected the ai.onnx opset 18-23 alone"),
    "other-weights": (lambda graph, weights: graph.SerializeToString().replace(weights_sha256(weights).encode(),
                                                                               b"0" * 64),
                      "expected the graph exported from model.safetensors beside it, found one from other weights"),
    "other-labels": (lambda graph, weights: tied(with_output_of(graph, 1000), weights),
                     "expected its first output 'probabilities', float32 [10] (one per label in config.json), found"),
    "nan": (lambda graph, weights: graph_of([helper.make_node("Div", ["zeros", "zeros"], ["probabilities"])], [ZEROS],
                                            weights), "expected 10 finite probabilities summing to 1"),
    "memory-bomb": (lambda graph, weights: graph_of([
        helper.make_node("ConstantOfShape", ["huge"], ["filled"]),
        helper.make_node("ReduceSum", ["filled"], ["total"], keepdims=1),
        helper.make_node("Add", ["zeros", "total"], ["probabilities"])], [ZEROS, HUGE], weights),
        "expected it to run on"),
    "custom-op-in-a-loop": (lambda graph, weights: tied(with_custom_node_in(graph, "Loop"), weights),
                            "found com.example.Decode"),
    "custom-op-in-an-if": (lambda graph, weights: tied(with_custom_node_in(graph, "If"), weights),
                           "found com.example.Decode"),
    "external-data": (lambda graph, weights: tied(with_external_initializer(graph), weights),
                      "expected one self-contained file, found initializer '"),  # the graph's first initializer
    "external-data-in-an-if": (lambda graph, weights: tied(with_external_initializer(graph, "If"), weights),
                               "expected one self-contained file, found initializer 'hidden_weight' in external data"),
    "sum-0.5": (lambda graph, weights: tied(with_probabilities_halved(graph), weights),
                "finite probabilities summing to 1 for mnist_test_0000_label_7.png, found shape [10], sum 0.5"),
    "image-rank-4": (lambda graph, weights: tied(with_image_rank(graph, ["batch", "height", "width", "channels"]),
                                                 weights),
                     "expected one input 'image', uint8 [height, width, channels], found [('image', ['batch', "),
    "image-rank-unknown": (lambda graph, weights: tied(with_image_rank(graph, []), weights),
                           "expected one input 'image', uint8 [height, width, channels], found [('image', [])]"),
}


def with_output_of(model: onnx.ModelProto, classes: int) -> onnx.ModelProto:
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = classes
    return model


def body_of(model: onnx.ModelProto, op_type: str) -> onnx.GraphProto:
    """The graph inside the first `op_type` node (a Loop's body, an If's then_branch)."""
    node = next(node for node in model.graph.node if node.op_type == op_type)
    return next(attribute.g for attribute in node.attribute if attribute.name in ("body", "then_branch"))


def with_custom_node_in(model: onnx.ModelProto, op_type: str) -> onnx.ModelProto:
    """A custom operator hidden inside the first Loop or If of the graph, not at its top."""
    body_of(model, op_type).node.append(helper.make_node("Decode", ["image"], ["hidden"], domain="com.example"))
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


def with_external_initializer(model: onnx.ModelProto, op_type: str | None = None) -> onnx.ModelProto:
    """A weight whose bytes lie in another file (weights.bin), which a page's download lacks: one of
    the graph's own (op_type None), or one added inside the first `op_type` node's graph."""
    if op_type is None:
        tensor = model.graph.initializer[0]
    else:
        tensor = body_of(model, op_type).initializer.add()
        tensor.CopyFrom(numpy_helper.from_array(np.zeros(4, np.float32), "hidden_weight"))
    set_external_data(tensor, location="weights.bin")
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    return model


def with_probabilities_halved(model: onnx.ModelProto) -> onnx.ModelProto:
    """Probabilities in [0, 1] and finite, but summing to 0.5: each divided by 2 at the end."""
    producer = next(node for node in model.graph.node if "probabilities" in node.output)
    producer.output[list(producer.output).index("probabilities")] = "probabilities/whole"
    model.graph.initializer.append(numpy_helper.from_array(np.array(2, np.float32), "probabilities/two"))
    model.graph.node.append(helper.make_node("Div", ["probabilities/whole", "probabilities/two"], ["probabilities"]))
    return model


def with_image_rank(model: onnx.ModelProto, dims: list[str]) -> onnx.ModelProto:
    """The image input declared with `dims` axes instead of [height, width, channels]."""
    image = next(value for value in model.graph.input if value.name == "image")
    image.type.tensor_type.ClearField("shape")
    for name in dims:
        image.type.tensor_type.shape.dim.add().dim_param = name
    return model


SHIPPED = ["pipeline_explain.onnx", "pipeline_map.onnx", "pipeline.onnx"]  # what `space --static` takes first


def bundled_graph(model_dir: Path, shipped: str) -> Path:
    """The graph `space --static` bundles from `model_dir` once the graphs it would take before
    `shipped` are removed: pipeline_explain.onnx where the export wrote one (the bundled model has
    it), else pipeline_map.onnx, else pipeline.onnx."""
    for preferred in SHIPPED[:SHIPPED.index(shipped)]:
        (model_dir / preferred).unlink()
    return model_dir / shipped


# Every hostile graph in each graph a Space may bundle; one in the pipeline.onnx a Space falls
# back to where there is no map graph, so that graph is the one checked there.
REFUSAL_CASES = ([(shipped, case) for shipped in SHIPPED[:2] for case in BAD_PIPELINES]
                 + [("pipeline.onnx", "other-labels")])


@pytest.mark.parametrize("shipped, case", REFUSAL_CASES, ids=[f"{name}-{case}" for name, case in REFUSAL_CASES])
def test_a_pipeline_the_page_could_not_run_is_refused_before_the_static_space_is_written(model_dir, tmp_path,
                                                                                          shipped, case):
    """Each graph of BAD_PIPELINES is refused in one line naming what was found; nothing is written."""
    make, message = BAD_PIPELINES[case]
    graph = bundled_graph(model_dir, shipped)
    graph.write_bytes(make(onnx.load(str(graph)), model_dir / "model.safetensors"))
    code, stderr = static_space(model_dir, tmp_path / "space")
    assert code == 2, stderr
    assert_one_line(stderr, shipped, message)
    assert not (tmp_path / "space").exists()


@pytest.mark.parametrize("shipped", SHIPPED)
def test_the_bundled_pipeline_passes_and_is_bundled(model_dir, tmp_path, shipped):
    graph = bundled_graph(model_dir, shipped)
    assert static_space(model_dir, tmp_path / "space") == (0, "")
    assert (tmp_path / "space" / "model" / shipped).read_bytes() == graph.read_bytes()


@pytest.mark.parametrize("shipped", SHIPPED)
def test_a_pipeline_linked_out_of_the_model_folder_is_refused(model_dir, tmp_path, shipped):
    graph = bundled_graph(model_dir, shipped)
    outside = shutil.copy(graph, tmp_path / "outside.onnx")
    graph.unlink()
    graph.symlink_to(outside)
    code, stderr = static_space(model_dir, tmp_path / "space")
    assert code == 2
    assert_one_line(stderr, f"expected regular files inside {model_dir}, found {shipped}, a link leading out")
    assert not (tmp_path / "space").exists()


def test_a_sample_that_decodes_to_100_megapixels_is_not_offered(model_dir, tmp_path):
    """About 100 KB on disk, 100 MP (1.3 GB in a visitor's browser) decoded: left out."""
    samples = model_dir / "samples"
    samples.mkdir()
    shutil.copy(ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png", samples / "00_class7.png")
    Image.new("1", (10_000, 10_000)).save(samples / "01_class1.png")
    assert (samples / "01_class1.png").stat().st_size < 2**20
    assert kept_samples(model_dir) == [samples / "00_class7.png"]
    assert static_space(model_dir, tmp_path / "space")[0] == 0
    assert sorted(path.name for path in (tmp_path / "space" / "samples").iterdir()) == ["00_class7.png"]
