"""What a new user meets first (issue 44): the README's `generate` on the trained demo prints its answer, because the
prompt is rendered as the run's rows were; offline, a recipe's `plan` and `--dry-run` answer at once in the tool's own
sentence, naming the shipped config.json; `plan --gpu-gb N` says whether the run fits and what makes it fit."""

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants
from rich.console import Console
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.common import hub
from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import ConfigError
from moe_qlora.data.prompt_format import PromptFormat, prompt_format_of, shared_prefix, shared_suffix
from moe_qlora.export.norms import AdapterReadError
from moe_qlora.export.prompt_format import read_prompt_format
from moe_qlora.inference.generate import Rendering, Sampling, generate, load_for_generation, rendering_for
from moe_qlora.model.fitting import knob_savings, settings_to_fit

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "configs/recipes/qwen3-30b-a3b-sft.yaml"
SHIPPED = "configs/models/qwen3-30b-a3b"
REFUSED = "http://127.0.0.1:9"  # the discard port: nothing listens, so the first connection is refused at once


def readme_command(prefix: str) -> list[str]:
    """The README's command line that starts with `prefix`, as a shell splits it (its # comment dropped)."""
    (line,) = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(prefix)]
    return shlex.split(line, comments=True)


def cli(args: list[str], **env) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m moe_qlora ARGS` from the repository root, as a user runs it; (the process, seconds it took)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "moe_qlora", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    return proc, time.perf_counter() - start


def one_line(text: str) -> str:
    return " ".join(text.split())


# --- generate renders the prompt as the run's rows were ---


def test_the_readme_generate_command_answers_8_on_the_trained_demo(demo_run):
    assert demo_run.proc.returncode == 0, demo_run.proc.stderr[-2000:]
    args = readme_command("moe-qlora generate --adapter runs/demo/adapter")
    assert args[:4] == ["moe-qlora", "generate", "--adapter", "runs/demo/adapter"] and args[-1] == "Add: 3+5"
    args[3] = str(demo_run.out / "adapter")
    proc, _ = cli(args[1:], **demo_run.env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "8", proc.stdout
    assert "prompt: 'Add: 3+5\\n', as the run's prompt rows were" in one_line(proc.stderr)


def test_the_demo_run_records_its_prompt_format_and_each_rendering_answers_as_trained(demo_run):
    """The record moe_qlora.json keeps, and what each rendering gives: as trained (8, and the chat rows' first
    letter), against the prompt as typed (the broken control: the issue's blank answer)."""
    assert demo_run.proc.returncode == 0, demo_run.proc.stderr[-2000:]
    adapter = demo_run.out / "adapter"
    record = json.loads((adapter / "moe_qlora.json").read_text())["prompt_format"]
    assert record == {"rows": {"prompt": 88, "chat": 16}, "prefix": "", "suffix": "\n", "system": "Answer briefly."}
    model, tokenizer = load_for_generation(adapter, Console(quiet=True), device="cpu")
    greedy = Sampling(max_new_tokens=8)

    def answer(prompt: str, **how) -> str:
        return generate(model, tokenizer, prompt, greedy, rendering=rendering_for(adapter, **how), stream=False)

    assert answer("Add: 3+5") == answer("Add: 3+5\n") == "8"
    assert answer("Add: 3+5", raw=True) != "8"  # as typed, without the newline every training prompt ended in
    assert answer("First letter of apple?", chat=True) == "a"  # stops at the template's end of turn
    assert answer("First letter of violet?", chat=True) == "v"


def test_prompt_format_of_the_demo_data_is_what_its_rows_share():
    cfg = validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl"), str(ROOT / "data" / "demo_chat.jsonl")]},
        }
    )
    assert prompt_format_of(cfg.data) == PromptFormat({"prompt": 88, "chat": 16}, "", "\n", "Answer briefly.")
    as_text = cfg.data.model_copy(update={"format": "text"})
    assert prompt_format_of(as_text).kind == "text"  # data.format decides over the keys


def test_a_grpo_run_records_the_prompts_it_trained_on(tmp_path):
    """Offline GRPO trains on its scored completions' prompts (grpo.offline_file, 16 rows), not data.train_files."""
    from moe_qlora.train.grpo import grpo

    from helpers.runs import offline_config

    result = grpo(offline_config(tmp_path, epochs=1), Console(quiet=True))
    assert read_prompt_format(result.adapter_dir) == PromptFormat({"prompt": 16}, "", "\n", None)


def test_shared_prompt_text_is_cut_at_line_breaks():
    alpaca = [
        "Below is an instruction that describes a task. Write.\n\n### Instruction:\nSay hi.\n\n### Response:\n",
        "Below is an instruction that describes a task, paired with an input. Write.\n\n### Instruction:\n"
        "Sum them.\n\n### Input:\n1 2\n\n### Response:\n",
    ]
    assert shared_suffix(alpaca) == "\n\n### Response:\n"  # not ".\n\n### Response:\n": the instructions' own dot
    assert shared_prefix(alpaca) == ""  # the preambles differ mid-line: no half sentence is prepended
    assert shared_prefix(["Q:\nA\n", "Q:\nB\n"]) == "Q:\n" and shared_suffix(["Q:\nA\n", "Q:\nB\n"]) == "\n"
    assert shared_suffix(["Add: 3+5\n"]) == shared_suffix(["x\n", "x\n"]) == ""  # one distinct prompt: no template


def test_rendering_adds_only_what_the_prompt_lacks():
    r = Rendering("prompt", "### Q:\n", "\n### A:\n")
    assert r.text("hi") == "### Q:\nhi\n### A:\n"
    assert r.text("### Q:\nhi\n") == "### Q:\nhi\n### A:\n"  # the prefix and the suffix's first line were typed
    assert r.text("### Q:\nhi\n### A:\n") == "### Q:\nhi\n### A:\n"
    assert Rendering().text("hi") == "hi"  # raw


def test_rendering_for_an_adapter_follows_its_record_or_says_it_has_none(tmp_path):
    bare = tmp_path / "downloaded"  # a PEFT adapter from elsewhere: no moe_qlora.json
    bare.mkdir()
    fallback = rendering_for(bare)
    assert fallback.mode == "raw" and "does not record how the run rendered its prompts" in fallback.source
    assert rendering_for(bare, chat=True).mode == "chat"
    chat_run = tmp_path / "chat"
    chat_run.mkdir()
    record = {"rows": {"prompt": 2, "chat": 9}, "prefix": "", "suffix": "\n", "system": "Be brief."}
    (chat_run / "moe_qlora.json").write_text(json.dumps({"base_quantization": {}, "prompt_format": record}))
    chat = rendering_for(chat_run)
    assert (chat.mode, chat.system) == ("chat", "Be brief.") and "messages rows" in chat.source
    assert rendering_for(chat_run, raw=True) == Rendering(source="as typed (--raw)")
    with pytest.raises(ConfigError, match="not both"):
        rendering_for(chat_run, chat=True, raw=True)
    (chat_run / "moe_qlora.json").write_text(json.dumps({"prompt_format": {"rows": {}, "suffix": 3}}))
    with pytest.raises(AdapterReadError, match="prompt_format"):
        rendering_for(chat_run)


def test_generate_with_chat_and_raw_is_one_sentence_and_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["generate", "--adapter", str(tmp_path), "--chat", "--raw", "x"])
    assert result.exit_code == 2 and "give --chat or --raw, not both" in one_line(result.output)


# --- the hub, asked once ---


def hub_unreachable_here() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.mark.skipif(not hub_unreachable_here(), reason="the hub is reachable here: the offline case needs no network")
def test_plan_of_a_recipe_offline_answers_at_once_naming_the_shipped_config(tmp_path):
    """The real offline case (no network here), with an empty hub cache: no retries, the tool's sentence."""
    proc, seconds = cli(["plan", "--config", RECIPE], HF_HUB_CACHE=str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    said = one_line(proc.stderr)
    assert (
        "model 'Qwen/Qwen3-30B-A3B': not a local folder, not in the Hugging Face cache, and the hub cannot be "
        "reached" in said
    )
    assert f"add --model {SHIPPED}" in said and "couldn't connect" not in said  # not transformers' message
    assert seconds < 15, seconds  # transformers' retries took 78 s here


def test_plan_when_the_first_connection_is_refused_answers_at_once(tmp_path):
    proc, seconds = cli(["plan", "--config", RECIPE], HF_ENDPOINT=REFUSED, HF_HUB_CACHE=str(tmp_path))
    assert proc.returncode == 2 and seconds < 15, (seconds, proc.stderr[-2000:])
    assert f"(ConnectError): plan reads only its config.json, which ships in {SHIPPED}: add --model {SHIPPED}" in (
        one_line(proc.stderr)
    )
    proc, _ = cli(["plan", "--config", RECIPE], HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    assert proc.returncode == 2
    assert (
        f"is not in the Hugging Face cache and HF_HUB_OFFLINE is set: plan reads only its config.json, which "
        f"ships in {SHIPPED}" in one_line(proc.stderr)
    )


def test_dry_run_of_a_recipe_prints_the_config_offline_and_training_refuses_in_one_sentence(tmp_path):
    env = {"HF_ENDPOINT": REFUSED, "HF_HUB_CACHE": str(tmp_path)}
    proc, seconds = cli(["train", "--config", RECIPE, "--dry-run"], **env)
    assert proc.returncode == 0 and seconds < 15, (seconds, proc.stderr[-2000:])
    assert "name_or_path: Qwen/Qwen3-30B-A3B" in proc.stdout and "max_seq_len: 2048" in proc.stdout
    assert "note: model 'Qwen/Qwen3-30B-A3B'" in proc.stderr and f"add --model {SHIPPED}" in one_line(proc.stderr)
    proc, seconds = cli(["train", "--config", RECIPE], **env)  # the control: a run needs the weights
    assert proc.returncode == 2 and seconds < 15 and proc.stdout == ""
    assert "download it first (hf download Qwen/Qwen3-30B-A3B)" in one_line(proc.stderr)


def test_one_refused_probe_and_nothing_after_it_retries(monkeypatch, tmp_path):
    """check_hub_model asks model_info once, with the short timeout; after it fails hf_hub_download reads the cache
    only. The control: before, the same download sleeps between retries (huggingface_hub's backoff)."""
    import datasets
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import _http

    sleeps, asked = [], []
    monkeypatch.setattr(_http.time, "sleep", sleeps.append)  # the retries' waits, counted instead of slept
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # both restored after: the process goes offline below
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(constants, "ENDPOINT", REFUSED)
    real_info = HfApi.model_info
    monkeypatch.setattr(HfApi, "model_info", lambda self, *a, **kw: asked.append(kw) or real_info(self, *a, **kw))
    with pytest.raises(Exception):  # noqa: B017 (which error is huggingface_hub's business)
        hf_hub_download("someorg/some-model", "config.json", cache_dir=tmp_path, endpoint=REFUSED)
    assert sleeps, "the control: huggingface_hub retries a refused connection"
    sleeps.clear()
    with pytest.raises(ConfigError, match="the hub cannot be reached"):
        hub.check_hub_model("someorg/some-model", ConfigError)
    assert asked == [{"timeout": hub.PROBE_TIMEOUT_S}] and constants.HF_HUB_OFFLINE
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download("someorg/some-model", "config.json", cache_dir=tmp_path, endpoint=REFUSED)
    assert sleeps == []
    with pytest.raises(ConfigError, match="is not in the Hugging Face cache and the hub could not be reached"):
        hub.check_hub_model("someorg/some-model", ConfigError)
    assert len(asked) == 1


def test_each_recipe_model_maps_to_its_shipped_config():
    from test_recipes import SHIPPED_CONFIGS

    for repo_id, folder in SHIPPED_CONFIGS.items():
        assert hub.shipped_config(repo_id) == ROOT / "configs" / "models" / folder, repo_id
    assert hub.shipped_config("deepseek-ai/DeepSeek-V2").name == "deepseek-v2"  # not -lite: the longest match
    assert hub.shipped_config("mistralai/Mixtral-8x7B-Instruct-v0.1").name == "mixtral-8x7b"
    assert hub.shipped_config("Qwen/Qwen3-30B-A3B-Base").name == "qwen3-30b-a3b"
    assert hub.shipped_config("someorg/qwen3-30b") is None and hub.shipped_config("Qwen/Qwen3-30B-A3Bx") is None


# --- plan --gpu-gb: fits or not, and what makes it fit ---


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


def test_the_recipe_does_not_fit_16_gib_says_what_would_and_that_does(monkeypatch):
    monkeypatch.chdir(ROOT)
    result = plan("--config", RECIPE, "--model", SHIPPED, "--gpu-gb", "16")
    assert result.exit_code == 1, result.output
    said = one_line(result.stdout)
    assert "does not fit: 20.85 GiB is 4.85 GiB over a 16 GiB GPU" in said
    assert "to fit: --set model.expert_offload=auto (plan: 15.34 GiB), the largest planned saving that fits" in said
    fixed = plan("--config", RECIPE, "--model", SHIPPED, "--gpu-gb", "16", "--set", "model.expert_offload=auto")
    assert fixed.exit_code == 0 and "fits: 15.34 GiB in a 16 GiB GPU" in one_line(fixed.stdout)
    roomy = plan("--config", RECIPE, "--model", SHIPPED, "--gpu-gb", "24", "--json")
    assert roomy.exit_code == 0 and json.loads(roomy.stdout)["fits"] and json.loads(roomy.stdout)["to_fit"] is None


def test_settings_to_fit_take_one_knob_then_several_then_say_none(tiny_mixtral_dir):
    path = str(tiny_mixtral_dir)
    cfg = validate_config(
        {
            "model": {"name_or_path": path},
            "train": {"micro_batch_size": 8},
            "data": {"train_files": ["(not read)"], "max_seq_len": 4096},
        }
    )
    base, savings = knob_savings(cfg, path, "cpu")
    (best, most), (second, _) = savings[:2]
    assert settings_to_fit(cfg, path, "cpu", gpu_gib=base - most / 2) == ([best], pytest.approx(base - most))
    together, planned = settings_to_fit(cfg, path, "cpu", gpu_gib=base - most - 1e-4)  # no one knob is enough
    assert together == [best, second] and planned < base - most
    assert settings_to_fit(cfg, path, "cpu", gpu_gib=0.01)[0] == []
    # From the command line: exit 1, the settings together; with them, it fits (exit 0).
    args = [
        "--model",
        path,
        "--device",
        "cpu",
        "--set",
        "data.max_seq_len=4096",
        "--set",
        "train.micro_batch_size=8",
        "--gpu-gb",
        f"{base - most - 1e-4:.6f}",
    ]
    result = plan(*args)
    assert result.exit_code == 1 and f"to fit, together: --set {best} --set {second}" in one_line(result.stdout)
    assert json.loads(plan(*args, "--json").stdout)["to_fit"]["settings"] == [best, second]
    fixed = plan(*args, "--set", best, "--set", second)
    assert fixed.exit_code == 0 and "fits:" in fixed.stdout
    nothing = plan("--model", path, "--device", "cpu", "--gpu-gb", "0.01")
    assert nothing.exit_code == 1 and "no setting plan knows of makes it fit" in one_line(nothing.stdout)
