"""Strict config: unknown keys with the nearest valid one, wrong types with the key path and line."""

from pathlib import Path

import pytest

from moe_qlora.config.load import load_config, parse_overrides
from moe_qlora.config.sections import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


BASE = "model:\n  name_or_path: builtin:tiny-mixtral\ndata:\n  train_files: [a.jsonl]\n"


def test_unknown_key_names_it_its_line_and_the_nearest_valid_key(tmp_path):
    path = write(tmp_path, BASE + "train:\n  lr: 1.0e-4\n  micro_batchsize: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:7: unknown key 'train.micro_batchsize'" in msg
    assert "did you mean 'train.micro_batch_size'" in msg


def test_wrong_type_and_range_name_the_key_path_and_expectation(tmp_path):
    path = write(tmp_path, BASE + "lora:\n  rank: eight\ntrain:\n  gclip: -1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:6: lora.rank: Input should be a valid integer" in msg
    assert f"{path}:8: train.gclip: Input should be greater than or equal to 0" in msg


def test_missing_section_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="missing required key 'data'"):
        load_config(write(tmp_path, "model:\n  name_or_path: x\n"))
    with pytest.raises(ConfigError, match=r"cfg.yaml:2: not valid YAML"):
        load_config(write(tmp_path, "model:\n  - : : [\n"))


def test_set_overrides_merge_and_are_validated(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path, ["train.lr=2e-4", "lora.rank=16", "lora.target_modules=[q_proj]"])
    assert (cfg.train.lr, cfg.lora.rank, cfg.lora.target_modules) == (2e-4, 16, ["q_proj"])
    with pytest.raises(ConfigError, match="unknown key 'train.lrr'"):
        load_config(path, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_overrides(["train.lr"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate_and_say_how_to_run(path):
    load_config(path)
    assert path.read_text().startswith("# moe-qlora ")


def test_contradictory_options_are_refused(tmp_path):
    path = write(tmp_path, BASE + "train:\n  max_steps: 2\n  save_every: 3\n")
    with pytest.raises(ConfigError, match=r"train.save_every \(3\) is beyond train.max_steps \(2\)"):
        load_config(path)


def test_relative_paths_resolve_against_the_config_file_and_set_against_the_cwd(tmp_path, monkeypatch):
    """As in torchtune and axolotl: a config's paths mean the same from any directory; --set values are
    typed at the shell, so they are relative to it."""
    folder = tmp_path / "project" / "configs"
    folder.mkdir(parents=True)
    path = folder / "run.yaml"
    path.write_text(
        "model: {name_or_path: 'builtin:tiny-mixtral'}\n"
        "lora: {init_from: ../runs/old/adapter}\n"
        "data: {train_files: [../data/a.jsonl, /abs/b.jsonl]}\n"
        "output: {dir: ../runs/new}\n"
        "grpo: {offline_file: scored.jsonl, rewards: [{function: rewards.py:score}, {function: exact_match}]}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    project = str(tmp_path / "project")
    assert cfg.data.train_files == [f"{project}/data/a.jsonl", "/abs/b.jsonl"]
    assert cfg.output.dir == f"{project}/runs/new"
    assert cfg.lora.init_from == f"{project}/runs/old/adapter"
    assert cfg.grpo.offline_file == f"{folder}/scored.jsonl"
    assert [r.function for r in cfg.grpo.rewards] == [f"{folder}/rewards.py:score", "exact_match"]
    cfg = load_config(path, ["data.train_files=[mine.jsonl]", "output.dir=out"])
    assert cfg.data.train_files == [f"{elsewhere}/mine.jsonl"] and cfg.output.dir == f"{elsewhere}/out"


def test_a_missing_data_file_is_named_by_the_absolute_path_tried(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moe_qlora.cli.app import app

    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "run.yaml"
    path.write_text(
        "model: {name_or_path: 'builtin:tiny-mixtral'}\ndata: {train_files: [good.jsonl]}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\n"
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--config", "cfg/run.yaml"])
    assert result.exit_code == 2
    assert str(tmp_path / "cfg" / "good.jsonl") in " ".join(result.output.split())
