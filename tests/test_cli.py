"""`vit-hub` end to end on tiny data (train -> eval -> predict -> info -> sweep), and every bad
input answered with one `error: ...` line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_TRAIN_FLAGS, read_json, tiny_config, write_class_folders
from vit_hub import cli
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.model.flops import layer_rows

REPO = Path(__file__).resolve().parents[1]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """`vit-hub ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(arg) for arg in argv])
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def run_module(*argv, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m vit_hub ARGV` in a fresh process, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "vit_hub", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def assert_one_error_line(code: int, stderr: str, fragment: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in stderr


# End to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(split_image_folder, tmp_path_factory):
    """`vit-hub train` on the train/test folder: 3 epochs of a one-block width-16 model."""
    out = tmp_path_factory.mktemp("cli") / "model"
    argv = ["train", "--data", split_image_folder, "--out", out, "--epochs", "3", *TINY_TRAIN_FLAGS]
    code, stdout, stderr = run_main(argv)
    assert code == 0, stderr
    return dict(out=out, stdout=stdout, argv=[str(arg) for arg in argv])


def test_train_prints_a_summary_line_and_writes_the_model_dir(trained):
    out = trained["out"]
    summary = json.loads(trained["stdout"].strip().splitlines()[-1])
    assert summary["out"] == str(out) and summary["split"] == "test" and summary["n"] == 16
    assert summary["accuracy"] >= 0.9
    for name in ("config.json", "model.safetensors", "README.md", "metrics.json", "curves.png",
                 "confusion_matrix.png"):
        assert (out / name).is_file(), name


def test_model_card_records_the_exact_training_command(trained):
    card = (trained["out"] / "README.md").read_text()
    assert " ".join(["vit-hub", *trained["argv"]]) in card
    assert read_json(trained["out"] / "metrics.json")["settings"]["command"].startswith("vit-hub train --data ")


def test_eval_of_a_plain_class_folder_defaults_to_val(trained, split_image_folder):
    """A folder of class subfolders has no test split: eval takes the val split it carves."""
    code, stdout, stderr = run_main(["eval", "--model", trained["out"], "--data", split_image_folder / "train"])
    assert code == 0, stderr
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["split"] == "val" and result["n"] > 0


def test_eval_prints_one_json_line(trained, split_image_folder):
    code, stdout, stderr = run_main(["eval", "--model", trained["out"], "--data", split_image_folder])
    assert code == 0, stderr
    lines = stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["n"] == 16 and result["split"] == "test"
    assert 0.9 <= result["accuracy"] <= 1.0 and result["loss"] > 0
    final = read_json(trained["out"] / "metrics.json")["final"]
    assert result["accuracy"] == final["accuracy"] and result["loss"] == pytest.approx(final["loss"], rel=1e-6)


def test_eval_on_a_folder_with_a_corrupt_file_still_prints_only_json(trained, image_folder, corrupt_file):
    code, stdout, stderr = run_main(["eval", "--model", trained["out"], "--data", image_folder, "--split", "train"])
    assert code == 0, stderr
    assert json.loads(stdout)["n"] == 45  # 49 files less a tenth of each class; the corrupt one replaced
    assert str(corrupt_file) in stderr  # met in the training split, named after the evaluation


def test_predict_prints_top_k_labels_with_probabilities(trained, split_image_folder):
    files = [split_image_folder / "test" / "bright_disc" / "104_RGB.png",
             split_image_folder / "test" / "dark_square" / "102_I16.png"]
    code, stdout, stderr = run_main(["predict", "--model", trained["out"], "--top-k", "2", *files])
    assert code == 0, stderr
    lines = stdout.strip().splitlines()
    assert len(lines) == 2
    for line, path, expected in zip(lines, files, ["bright_disc", "dark_square"]):
        shown, _, ranking = line.partition(": ")
        assert shown == str(path)
        pairs = re.findall(r"(\w+) (\d\.\d{3})", ranking)
        assert [label for label, _ in pairs][0] == expected
        assert sorted(label for label, _ in pairs) == ["bright_disc", "dark_square"]
        probabilities = [float(value) for _, value in pairs]
        assert probabilities == sorted(probabilities, reverse=True)
        assert sum(probabilities) == pytest.approx(1.0, abs=2e-3)


def test_predict_top_1(trained, split_image_folder):
    image = split_image_folder / "test" / "dark_square" / "105_RGB.jpg"
    code, stdout, _ = run_main(["predict", "--model", trained["out"], "--top-k", "1", image])
    assert code == 0 and re.fullmatch(rf"{re.escape(str(image))}: dark_square \d\.\d{{3}}", stdout.strip())


def test_info_on_a_model_dir_prints_a_per_layer_table(trained):
    code, stdout, _ = run_main(["info", "--model", trained["out"]])
    assert code == 0
    lines = stdout.strip().splitlines()
    assert lines[0] == ("VisionTransformer: 16x16x3 input, patch 4x4, 17 tokens, dim 16, depth 1, heads 2, "
                        "2 classes")
    assert lines[1].split() == ["layer", "parameters", "MFLOPs"]
    assert [line.split()[0] for line in lines[2:]] == ["patch_embedding", "blocks.0.attention", "blocks.0.mlp",
                                                       "norm", "total"]
    model = HubVisionTransformer.from_pretrained(str(trained["out"]))
    total_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert lines[-1].split()[1] == f"{total_parameters:,}"
    row_parameters = sum(int(line.split()[-2].replace(",", "")) for line in lines[2:-1])
    assert row_parameters == total_parameters


def test_info_on_a_preset():
    code, stdout, _ = run_main(["info", "--preset", "mnist"])
    assert code == 0
    assert stdout.startswith("VisionTransformer: 28x28x1 input, patch 4x4, 50 tokens, dim 64, depth 6, heads 4, "
                             "10 classes")
    assert stdout.count("blocks.") == 12


def test_layer_flops_are_the_matmul_arithmetic_of_inference():
    model = HubVisionTransformer(**tiny_config(depth=2))  # 16x16x3, patch 4: 16 patches, 17 tokens, dim 16
    rows = {name: flops for name, _, flops in layer_rows(model)}
    tokens, dim, hidden = 17, 16, 32
    assert rows["patch_embedding + cls + positions"] == 2 * 16 * (3 * 4 * 4) * dim
    qkv = 2 * tokens * dim * 3 * dim
    assert rows["blocks.0.attention"] == qkv + 2 * 2 * tokens * tokens * dim + 2 * tokens * dim * dim
    assert rows["blocks.0.mlp"] == 2 * 2 * tokens * dim * hidden
    # The last block computes the class token alone: 1 query, 1 output projection, 1 MLP row.
    assert rows["blocks.1.attention"] == qkv + 2 * 2 * 1 * tokens * dim + 2 * 1 * dim * dim
    assert rows["blocks.1.mlp"] == 2 * 2 * 1 * dim * hidden
    assert rows["norm + head"] == 2 * dim * 2


def test_sweep_writes_a_table_and_plots(split_image_folder, tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", "--data", split_image_folder, "--out", out, "--epochs", "1",
            "--param", "num_heads=1,2", "--param", "lr=0.001,0.003", *TINY_TRAIN_FLAGS]
    code, stdout, stderr = run_main(argv)
    assert code == 0, stderr
    lines = stdout.strip().splitlines()  # each run's progress, then the table
    table = lines[max(index for index, line in enumerate(lines) if line.startswith("| parameter |")):]
    assert table[0].startswith("| parameter | value | best val accuracy |")
    assert [row.split("|")[1:3] for row in table[2:]] == [
        [" num_heads ", " 1 "], [" num_heads ", " 2 "], [" lr ", " 0.001 "], [" lr ", " 0.003 "]]
    assert (out / "sweep.md").read_text().strip() == "\n".join(table)
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = read_json(out / "sweep.json")
    assert [row["value"] for row in results["num_heads"]] == [1, 2]
    assert all(0.0 <= row["best_val_accuracy"] <= 1.0 for rows in results.values() for row in rows)
    assert read_json(out / "num_heads=2" / "config.json")["num_heads"] == 2
    assert read_json(out / "lr=0.003" / "metrics.json")["settings"]["lr"] == 0.003


def test_sweep_resume_keeps_finished_runs_and_continues_the_interrupted_one(split_image_folder, tmp_path):
    """The state an interrupted sweep leaves: heads=1 finished, heads=2 stopped after 1 of 2
    epochs (as Ctrl-C leaves it: the last epoch's checkpoint), heads=4 not started."""
    out = tmp_path / "sweep"
    flags = ["--data", split_image_folder, "--epochs", "2", *TINY_TRAIN_FLAGS]
    assert run_main(["train", "--out", out / "num_heads=1", "--num-heads", "1", *flags])[0] == 0
    assert run_main(["train", "--out", out / "num_heads=2", "--num-heads", "2", "--stop-after-epochs", "1",
                     *flags])[0] == 0
    finished_weights = (out / "num_heads=1" / "model.safetensors").read_bytes()
    sweep = ["sweep", "--out", out, "--param", "num_heads=1,2,4", *flags]

    code, _, stderr = run_main(sweep)
    assert_one_error_line(code, stderr, "pass --resume to continue")
    code, stdout, stderr = run_main([*sweep, "--resume"])
    assert code == 0, stderr
    assert f"sweep: {out / 'num_heads=1'} is finished" in stdout
    assert f"sweep: continuing {out / 'num_heads=2'} from its checkpoint" in stdout
    assert (out / "num_heads=1" / "model.safetensors").read_bytes() == finished_weights
    for heads in (1, 2, 4):
        assert len(read_json(out / f"num_heads={heads}" / "metrics.json")["history"]) == 2
    assert [row["value"] for row in read_json(out / "sweep.json")["num_heads"]] == [1, 2, 4]


# Bad input: one line, exit code 2 --------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    write_class_folders(root / "one_class", per_class=2, seed=0)
    for path in (root / "one_class" / "dark_square").iterdir():
        path.unlink()
    (root / "one_class" / "dark_square").rmdir()
    (root / "no_images" / "a").mkdir(parents=True)
    (root / "no_images" / "b").mkdir()
    (root / "not_an_image.png").write_bytes(b"plain text")
    mismatched = root / "mismatched"
    HubVisionTransformer(**tiny_config()).save_pretrained(mismatched)
    config = read_json(mismatched / "config.json")
    (mismatched / "config.json").write_text(json.dumps({**config, "embed_dim": 32}))
    return root


CLI_ERRORS = [
    (["train", "--data", "{root}/missing", "--out", "{root}/o"], "--data: expected a folder of images"),
    (["train", "--data", "{root}/empty", "--out", "{root}/o"], "expected class subfolders in"),
    (["train", "--data", "{root}/one_class", "--out", "{root}/o"], "expected at least 2 classes"),
    (["train", "--data", "{root}/no_images", "--out", "{root}/o"], "found no readable images in"),
    (["train", "--data", "cifar10", "--data-root", "{root}/empty", "--out", "{root}/o"],
     "cifar10: expected torchvision's CIFAR10 files under --data-root"),
    (["train", "--out", "{root}/o"], "train: expected --data"),
    (["train", "--resume", "--out", "{root}/empty"], "--resume: expected a checkpoint at"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--embed-dim", "16", "--num-heads", "3"],
     "embed_dim 16 is not divisible by num_heads 3"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--image-size", "30", "--patch-size", "4"],
     "image height 30 is not divisible by patch height 4"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--epochs", "0"], "--epochs: expected a positive int"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--label-smoothing", "1.5"], "--label-smoothing"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--val-split", "1"], "--val-split: expected a fraction"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--in-channels", "3", "--mean", "0.1,0.2"],
     "mean: expected 3 values"),
    (["train", "--data", "{split}", "--out", "{root}/o", "--mlp-ratio", "-1"], "mlp_ratio: expected a positive"),
    (["eval", "--model", "{root}/empty", "--data", "{split}"], "expected config.json in"),
    (["eval", "--model", "{root}/mismatched", "--data", "{split}"], "do not match the config"),
    (["predict", "--model", "{root}/mismatched", "{root}/not_an_image.png"], "do not match the config"),
    (["info", "--model", "{root}/mismatched"], "do not match the config"),
    (["sweep", "--data", "{split}", "--out", "{root}/s", "--param", "colour=1,2"], "--param: expected NAME=V1,V2"),
]


@pytest.mark.parametrize("argv, fragment", CLI_ERRORS, ids=[" ".join(argv[:2]) + f" #{index}"
                                                            for index, (argv, _) in enumerate(CLI_ERRORS)])
def test_bad_input_gives_one_error_line_and_exit_code_2(bad_inputs, split_image_folder, argv, fragment):
    argv = [arg.format(root=bad_inputs, split=split_image_folder) for arg in argv]
    code, _, stderr = run_main(argv)
    assert_one_error_line(code, stderr, fragment)


def test_bad_images_for_predict(trained, bad_inputs):
    code, _, stderr = run_main(["predict", "--model", trained["out"], bad_inputs / "not_an_image.png"])
    assert_one_error_line(code, stderr, f"{bad_inputs / 'not_an_image.png'} is not a readable image")
    code, _, stderr = run_main(["predict", "--model", trained["out"], bad_inputs / "nope.png"])
    assert_one_error_line(code, stderr, f"expected an image file at {bad_inputs / 'nope.png'}")


def test_eval_on_data_with_other_labels(trained):
    code, _, stderr = run_main(["eval", "--model", trained["out"], "--data", "mnist"])
    assert_one_error_line(code, stderr, "do not match the model's ['bright_disc', 'dark_square']")


def test_strict_training_fails_naming_the_corrupt_file(image_folder, corrupt_file, tmp_path):
    code, _, stderr = run_main(["train", "--data", image_folder, "--out", tmp_path / "o", "--strict",
                                *TINY_TRAIN_FLAGS])
    assert_one_error_line(code, stderr, f"unreadable image {corrupt_file}")


@pytest.mark.parametrize("argv, message", [
    (["info", "--preset", "huge"], "vit-hub info: error: argument --preset: invalid choice: 'huge'"),
    (["train", "--data", "mnist"], "vit-hub train: error: the following arguments are required: --out"),
    (["train", "--out", "x", "--epochs", "many"], "vit-hub train: error: argument --epochs: invalid int value"),
    (["fly"], "vit-hub: error: argument command: invalid choice: 'fly'"),
])
def test_usage_errors_are_one_line_too(argv, message):
    code, _, stderr = run_main(argv)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and lines[0].endswith("--help)")


# As a separate process ----------------------------------------------------------------------------------
def test_python_m_vit_hub_reports_errors_without_traceback(tmp_path):
    result = run_module("train", "--data", tmp_path / "missing", "--out", tmp_path / "out")
    assert_one_error_line(result.returncode, result.stderr, "--data: expected a folder of images")
    assert result.stdout == ""


def test_python_m_vit_hub_predicts_with_a_trained_model(trained, split_image_folder):
    image = split_image_folder / "test" / "bright_disc" / "106_L.png"
    result = run_module("predict", "--model", trained["out"], image)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{image}: bright_disc ")


def test_console_script_lists_every_command():
    script = Path(sys.executable).with_name("vit-hub")
    assert script.exists(), "the vit-hub console script is not installed (make install)"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for command in ("train", "eval", "predict", "info", "sweep"):
        assert command in result.stdout


def test_ctrl_c_exits_130_without_traceback(monkeypatch):
    def interrupt(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "info", interrupt)
    code, _, stderr = run_main(["info", "--preset", "mnist"])
    assert code == 130 and "Traceback" not in stderr


def test_a_bug_keeps_its_traceback_and_a_user_error_is_one_line():
    """A ValueError raised by a bug is not a user's mistake: it is not printed as `error: ...`
    with exit 2 but goes on with its traceback (exit 1); a UserError is one line, exit 2."""
    code = ("import sys\n"
            "from vit_hub import cli\n"
            "from vit_hub.errors import UserError\n"
            "def broken(args): raise {error}('{message}')\n"
            "cli.COMMANDS['info'] = broken\n"
            "sys.exit(cli.main(['info', '--preset', 'mnist']))\n")
    bug = subprocess.run([sys.executable, "-c", code.format(error="ValueError", message="a bug")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bug.returncode == 1 and "Traceback (most recent call last)" in bug.stderr, bug.stderr
    assert bug.stderr.strip().splitlines()[-1] == "ValueError: a bug" and "error: a bug" not in bug.stderr
    mistake = subprocess.run([sys.executable, "-c", code.format(error="UserError", message="a mistake")],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
    assert_one_error_line(mistake.returncode, mistake.stderr, "error: a mistake")


def test_train_flags_are_generated_from_the_dataclasses():
    """One flag per settable ViTConfig field and per TrainSettings field, each with help; a
    run with no flags gets exactly the dataclass defaults, and a flag reaches its field."""
    import dataclasses

    from vit_hub.model.config import ViTConfig
    from vit_hub.train.settings import MODEL_FIELDS, TrainSettings

    parser = cli.build_parser()
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    helps = {action.dest: action.help for action in train_parser._actions}
    expected = set(MODEL_FIELDS) | {field.name for field in dataclasses.fields(TrainSettings)} - {"model", "command"}
    assert expected <= set(helps)
    assert all(helps[name] for name in expected), [name for name in expected if not helps[name]]
    assert "(training measures them on the training split unless given)" in helps["mean"]  # continued docstring line
    fitted_or_from_data = {"num_classes", "labels", "temperature"}  # no flag: the run decides them
    assert set(MODEL_FIELDS) == {field.name for field in dataclasses.fields(ViTConfig)} - fitted_or_from_data

    defaults = cli._settings(parser.parse_args(["train", "--data", "mnist", "--out", "o"]))
    assert defaults == TrainSettings(data="mnist", out="o", command=defaults.command)
    given = cli._settings(parser.parse_args(["train", "--data", "mnist", "--out", "o", "--workers", "3", "--no-strict",
                                             "--patch-size", "4x8", "--mean", "0.1,0.2,0.3", "--no-qkv-bias"]))
    assert (given.num_workers, given.strict) == (3, False)
    assert given.model == {"patch_size": [4, 8], "mean": [0.1, 0.2, 0.3], "qkv_bias": False}


def test_a_field_without_a_command_line_type_is_refused_by_name():
    import dataclasses

    @dataclasses.dataclass
    class Odd:
        """Args:
            shape: a tuple.
        """

        shape: tuple = ()

    with pytest.raises(TypeError, match=r"Odd.shape: no command-line type for the annotation 'tuple'"):
        cli.add_field_flags(argparse.ArgumentParser(), Odd, ("shape",))
