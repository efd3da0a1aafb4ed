"""Bad input a new user types, second round: each is one sentence and exit 2, and the ones the config alone
can tell come back before torch is imported (so at once, not after seconds of imports)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "demo_sft.jsonl"

# Runs the CLI in-process in a fresh interpreter, then reports the exit code and whether torch got imported.
DRIVER = """
import json, sys
from moe_qlora.cli.app import main
sys.argv = ["moe-qlora", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def cli(args: list[str], **env) -> tuple[int, bool, str]:
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["code"], result["torch"], " ".join(proc.stderr.split())


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"model: {{name_or_path: 'builtin:tiny-mixtral'}}\ndata: {{train_files: [{DATA}]}}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\n"
    )
    return path


def test_a_mistyped_key_suggests_the_nearest_one_before_any_heavy_import(config):
    code, torch_imported, err = cli(["train", "--config", str(config), "--set", "train.learning_rate=1"])
    assert code == 2 and not torch_imported
    assert "unknown key 'train.learning_rate'; did you mean 'train.lr'?" in err and "valid here" not in err


def test_a_missing_data_file_is_named_before_any_heavy_import(config, tmp_path):
    code, torch_imported, err = cli(["train", "--config", str(config), "--set", "data.train_files=[nope.jsonl]"])
    assert code == 2 and not torch_imported
    assert f"{Path.cwd() / 'nope.jsonl'}: no such file" in err


@pytest.mark.parametrize(
    ("command", "sets", "world", "refused"),
    [
        ("grpo", [], "1", "no `grpo:` section"),
        ("train", ["train.optimizer_in_backward=true"], "2", "optimizer_in_backward steps inside each rank"),
        ("train", ["train.parallel=fsdp", "train.optimizer=adamw_8bit"], "2", "keeps bitsandbytes state"),
    ],
)
def test_a_method_check_refuses_at_once_even_in_a_dry_run(config, command, sets, world, refused):
    """The recipes' checks (config/methods.py) run before any heavy import, --dry-run included. The control: the
    same dry run of a config that passes them prints it (exit 0)."""
    args = [command, "--config", str(config), *(a for s in sets for a in ("--set", s)), "--dry-run"]
    code, torch_imported, err = cli(args, WORLD_SIZE=world)
    assert code == 2 and not torch_imported and refused in err
    if command == "train":
        code, _, _ = cli(args, WORLD_SIZE="1")
        assert code == 0


def test_a_hub_id_while_offline_fails_at_once_in_one_sentence(config):
    code, torch_imported, err = cli(
        ["train", "--config", str(config), "--set", "model.name_or_path=someorg/no-moe"], HF_HUB_OFFLINE="1"
    )
    assert code == 2 and not torch_imported and "Traceback" not in err
    assert "'someorg/no-moe' is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in err
    assert "local folder" in err


def test_an_output_dir_that_is_a_file_is_refused_before_loading(config, tmp_path):
    (tmp_path / "taken").write_text("x")
    code, torch_imported, err = cli(["train", "--config", str(config), "--set", f"output.dir={tmp_path / 'taken'}"])
    assert code == 2 and not torch_imported
    assert f"output.dir: {tmp_path / 'taken'} is a file, not a folder" in err


def test_a_mistyped_builtin_model_suggests_the_right_one(config):
    code, _, err = cli(["train", "--config", str(config), "--set", "model.name_or_path=builtin:tiny-mixtrl"])
    assert code == 2 and "Traceback" not in err
    assert "unknown builtin model 'builtin:tiny-mixtrl'; did you mean 'builtin:tiny-mixtral'?" in err
