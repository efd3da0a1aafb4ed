"""Datasets by name and folder: save_to_disk folders, a hub id read from an offline cache, column layouts
(ShareGPT, Alpaca, explicit mappings), path resolution, and the one-sentence errors. Nothing is downloaded."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from moe_qlora.config.load import load_config
from moe_qlora.config.sections import DataSection, DataSource
from moe_qlora.data.examples import build_examples
from moe_qlora.data.sources import DataError, load_rows, standard_columns
from moe_qlora.model.tiny import build_byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOK = build_byte_tokenizer()
ALPACA = [
    {"instruction": "Add the numbers", "input": "2+3", "output": "5"},
    {"instruction": "Say hi", "input": "", "output": "hi"},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": "Hello."},
        ]
    }
]


def decoded_target(example) -> str:
    return TOK.decode([t for t in example.labels if t != -100], skip_special_tokens=True)


def test_alpaca_rows_become_prompt_and_completion():
    row = standard_columns(ALPACA[0], "x:1")
    assert row["prompt"].endswith("### Instruction:\nAdd the numbers\n\n### Input:\n2+3\n\n### Response:\n")
    assert row["completion"] == "5"
    assert "### Input" not in standard_columns(ALPACA[1], "x:2")["prompt"]


def test_sharegpt_conversations_become_messages_and_bad_roles_are_named():
    row = standard_columns(SHAREGPT[0], "x:1")
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][2]["content"] == "Hello."
    with pytest.raises(DataError, match=r"x:1: conversations\[0\] from 'bot': expected one of human"):
        standard_columns({"conversations": [{"from": "bot", "value": "?"}]}, "x:1")


def test_save_to_disk_folders_dataset_and_datasetdict(tmp_path):
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "alpaca"))
    examples, stats = build_examples(DataSection(train_files=[str(tmp_path / "alpaca")], max_seq_len=512), TOK)
    assert len(examples) == 2 and stats.formats == {"prompt_completion": 2}
    assert decoded_target(examples[0]) == "5" and examples[0].source == f"{tmp_path / 'alpaca'}:1"

    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ALPACA), "validation": datasets.Dataset.from_list(SHAREGPT)}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    rows = load_rows([DataSource(path=str(tmp_path / "dict"), split="validation")])
    assert len(rows) == 1 and rows[0][1]["messages"][1]["content"] == "Hi?"
    with pytest.raises(DataError, match=r"no split 'test' \(it has train, validation\)"):
        load_rows([DataSource(path=str(tmp_path / "dict"), split="test")])


def test_explicit_columns_are_renamed_and_missing_ones_named(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "4", "id": 7}) + "\n")
    source = DataSource(path=str(path), columns={"prompt": "question", "completion": "answer"})
    ((where, row),) = load_rows([source])
    assert row == {"prompt": "2+2?", "completion": "4", "id": 7} and where == f"{path}:1"
    with pytest.raises(DataError, match=r"qa.jsonl:1: data columns \['query'\] not in the row"):
        load_rows([DataSource(path=str(path), columns={"prompt": "query", "completion": "answer"})])


def fill_offline_cache(cache: Path, repo_id: str, rows: list[dict], tmp: Path) -> None:
    """What an earlier online `load_dataset(repo_id)` leaves in the datasets cache: an Arrow split under
    <namespace>___<name>/default/<version>/<hash>/ with its dataset_info.json (built here from a local file)."""
    src_file = tmp / "rows.jsonl"
    src_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.load_dataset("json", data_files=str(src_file), split="train", cache_dir=str(tmp / "build"))
    built = Path(glob.glob(str(tmp / "build" / "json" / "*" / "*" / "*"))[0])
    namespace, name = repo_id.split("/")
    target = cache / f"{namespace}___{name}" / "default" / built.parts[-2] / built.parts[-1]
    shutil.copytree(built, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", f"{name}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name="default", dataset_name=name, builder_name=name)
    (target / "dataset_info.json").write_text(json.dumps(info))


def run_offline(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_hub_id_is_read_from_the_offline_cache_and_a_missing_one_is_one_sentence(tmp_path):
    cache = tmp_path / "cache"
    fill_offline_cache(cache, "someorg/alpaca_mini", ALPACA, tmp_path)
    code = (
        "from moe_qlora.data.sources import load_rows\n"
        "rows = load_rows(['someorg/alpaca_mini'])\n"
        "print(rows[0][0], '|', rows[0][1]['completion'], '|', len(rows))"
    )
    proc = run_offline(code, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "someorg/alpaca_mini[train]:1 | 5 | 2"

    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"model: {{name_or_path: builtin:tiny-mixtral}}\ndata: {{train_files: [someorg/not_cached]}}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\n"
    )
    cmd = [sys.executable, "-m", "moe_qlora", "train", "--config", str(config)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(cache),
        "MOE_QLORA_CACHE": str(tmp_path / "moe-cache"),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert (
        "error: dataset 'someorg/not_cached' is not in the datasets cache and HF_HUB_OFFLINE is set: download "
        "it where there is a network"
    ) in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr


def test_config_paths_resolve_but_hub_ids_stay(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "model: {name_or_path: builtin:tiny-mixtral}\n"
        "data:\n  train_files:\n    - data/a.jsonl\n    - someorg/alpaca_mini\n"
        "    - {path: data, split: train}\n"
        "    - {path: otherorg/chat, name: en, columns: {messages: turns}}\n"
        "  eval_files: [missing.jsonl]\n"
    )
    cfg = load_config(config)
    a, hub, folder, mapped = cfg.data.train_files
    assert a == str(tmp_path / "data" / "a.jsonl") and hub == "someorg/alpaca_mini"
    assert folder.path == str(tmp_path / "data") and mapped.path == "otherorg/chat" and mapped.name == "en"
    assert cfg.data.eval_files == [str(tmp_path / "missing.jsonl")]  # named like a data file: a path, even if absent
