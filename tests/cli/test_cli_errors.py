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

# Runs the CLI in-process in a fresh interpreter, then reports the exit code, whether torch and datasets got
# imported, and whatever the Python given after the arguments adds to `result`.
DRIVER = """
import json, sys
args, after = json.loads(sys.argv[1]), sys.argv[2:]
from moe_qlora.cli.app import main
sys.argv = ["moe-qlora", *args]
try:
    main()
except SystemExit as exc:
    code = exc.code
result = {"code": code, "torch": "torch" in sys.modules, "datasets": "datasets" in sys.modules}
exec(after[0] if after else "")
print(json.dumps(result))
"""


def driver(args: list[str], *after: str, **env) -> tuple[dict, str]:
    """DRIVER's result and the standard error, spaces collapsed."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(args), *after],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), " ".join(proc.stderr.split())


def cli(args: list[str], **env) -> tuple[int, bool, str]:
    result, err = driver(args, **env)
    return result["code"], result["torch"], err


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
    """Said before torch is imported (it was said after 7 s of imports, when the recipe resolved the name)."""
    code, torch_imported, err = cli(
        ["train", "--config", str(config), "--set", "model.name_or_path=builtin:tiny-mixtrl"]
    )
    assert code == 2 and not torch_imported and "Traceback" not in err
    assert "unknown builtin model 'builtin:tiny-mixtrl'; did you mean 'builtin:tiny-mixtral'?" in err


def test_a_data_file_that_is_not_utf8_or_empty_is_named_before_any_heavy_import(config, tmp_path):
    """A byte that is not UTF-8 on line 2 (pyarrow reads the file and fails only when the row is read) ended in a
    UnicodeDecodeError traceback; an empty file was named only after the heavy imports. Both are one sentence
    naming the file (and the line and byte), exit 2, before torch is imported."""
    rows = tmp_path / "latin1.jsonl"
    rows.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "c"}\n')
    code, torch_imported, err = cli(["train", "--config", str(config), "--set", f"data.train_files=[{rows}]"])
    assert code == 2 and not torch_imported and "Traceback" not in err, err
    assert f"data.train_files: {rows}:2: not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, torch_imported, err = cli(["train", "--config", str(config), "--set", f"data.train_files=[{empty}]"])
    assert code == 2 and not torch_imported and f"{empty}: the file is empty: it holds no rows" in err, err


def test_cuda_asked_of_a_torch_without_cuda_is_one_sentence(config):
    """model.device: cuda where torch has no CUDA (this CPU build; on a GPU machine, no device visible) ended in
    torch's `AssertionError: Torch not compiled with CUDA enabled`."""
    sets = ["--set", "model.device=cuda", "--set", "train.max_steps=1"]
    code, _, err = cli(["train", "--config", str(config), *sets], CUDA_VISIBLE_DEVICES="")
    assert code == 2 and "Traceback" not in err and "AssertionError" not in err, err
    assert "model.device is cuda, but this machine has" in err and "or set model.device: auto" in err


def test_plan_of_a_path_that_is_neither_a_folder_nor_a_hub_id_is_one_sentence():
    """A relative path that does not exist, with more than one slash, ended in huggingface_hub's HFValidationError."""
    code, _, err = cli(["plan", "--model", "some/missing/relative/path"])
    assert code == 2 and "HFValidationError" not in err and "Traceback" not in err, err
    assert f"no such folder ({Path.cwd() / 'some/missing/relative/path'}), and not a hub id (owner/name)" in err


def test_debug_shows_the_traceback_and_keeps_the_exit_code(config):
    """--debug turned a user error's exit code 2 into a traceback's 1: a script checking the code read another
    failure. Now the traceback comes before the same sentence, and the code stays 2."""
    code, _, err = cli(["train", "--config", str(config), "--set", "data.train_files=[nope.jsonl]", "--debug"])
    assert code == 2 and "Traceback (most recent call last)" in err
    assert f"error: data.train_files: {Path.cwd() / 'nope.jsonl'}: no such file" in err


def trained_checkpoints(config: Path, out: Path, steps: dict[int, list[str]]) -> None:
    """Checkpoint folders as a run leaves them, for the config-identity check alone: each step's state.json
    records the config of `config` with that step's overrides (the tensors are not read before loading)."""
    from moe_qlora.config.load import load_config
    from moe_qlora.train.run_identity import config_identity

    for step, overrides in steps.items():
        folder = out / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        identity = config_identity(load_config(str(config), overrides).model_dump(mode="json"))
        (folder / "state.json").write_text(json.dumps({"step": step, **identity}))
        (folder / "manifest.json").write_text("{}")  # complete (the resume checks the hashes it lists)


def test_a_resume_with_another_config_is_refused_before_any_heavy_import(config, tmp_path):
    """Every checkpoint of the run was trained at lr 0.005: a resume at 0.001 is refused naming the newest and the
    key that changed, before torch is imported (it was refused only once the model had loaded). --resume-anyway
    skips the check: tests/train/test_resume.py resumes so."""
    trained_checkpoints(config, tmp_path / "out", {2: ["train.lr=0.005"], 4: ["train.lr=0.005"]})
    newest = tmp_path / "out" / "checkpoints" / "step-00000004"
    code, torch_imported, err = cli(["train", "--config", str(config), "--resume", "--set", "train.lr=0.001"])
    assert code == 2 and not torch_imported, err
    assert f"error: {newest}: the configuration differs from the one this checkpoint was trained with" in err
    assert "(train.lr 0.005 -> 0.001)" in err and "--resume-anyway" in err


def test_the_early_resume_check_refuses_only_where_every_checkpoint_differs(config, tmp_path):
    """refused_config: None where any checkpoint the resume could take has the config (a corrupt newer one is
    skipped by the resume), for a fresh run (resume: never), or with no checkpoint; a named checkpoint is
    compared alone. Control: the same folders with no matching checkpoint are refused."""
    from moe_qlora.config.load import load_config
    from moe_qlora.train.run_identity import refused_config

    out = tmp_path / "out"
    trained_checkpoints(config, out, {2: ["train.lr=0.001"], 4: ["train.lr=0.005"]})
    now = load_config(str(config), ["train.lr=0.001"]).model_dump(mode="json")
    assert refused_config(out, "never", now) is None
    assert refused_config(tmp_path / "elsewhere", "auto", now) is None
    assert refused_config(out, "auto", now) is None  # step 2 has it
    assert refused_config(out, str(out / "checkpoints" / "step-00000002"), now) is None
    named = refused_config(out, str(out / "checkpoints" / "step-00000004"), now)
    assert named.startswith(f"{out / 'checkpoints' / 'step-00000004'}: the configuration differs")
    other = load_config(str(config), ["train.lr=0.002"]).model_dump(mode="json")
    assert "(train.lr 0.005 -> 0.002)" in refused_config(out, "auto", other)
    # A folder without its manifest (incomplete) does not count; a state.json whose config is not a section tree
    # still gets the sentence, without the keys.
    (out / "checkpoints" / "step-00000002" / "manifest.json").unlink()
    assert refused_config(out, "auto", now).startswith(f"{out / 'checkpoints' / 'step-00000004'}: the config")
    state = out / "checkpoints" / "step-00000004" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "config": None}))
    assert refused_config(out, "auto", now).endswith(
        "with; resuming would not continue the same run (pass --resume-anyway to do it regardless)"
    )


def test_plan_never_imports_datasets_and_datasets_imported_later_is_quiet(config):
    """`datasets` (about 1 s of imports after torch's) is for the commands that read rows; the silencing of its
    logs and progress bars holds once it is imported (its environment variables, set before)."""
    quiet = (
        "import datasets\n"
        "result['quiet'] = datasets.logging.get_verbosity() == datasets.logging.ERROR"
        " and not datasets.is_progress_bar_enabled()"
    )
    result, err = driver(["plan", "--config", str(config)], quiet)
    assert (result["code"], result["datasets"], result["quiet"]) == (0, False, True), err[-2000:]
