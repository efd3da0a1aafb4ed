"""model.chat_template (issue 62: the chat-template override TRL and axolotl users look for): a Jinja file that
replaces the tokenizer's own template for the run's messages rows, kept in the adapter folder as
chat_template.jinja, from which `moe-qlora generate` renders and which `merge` puts in the merged model.

A 2-step run of the demo's chat rows with a template of its own markers: the rows are rendered through it (its
markers in the tokens, the builtin's absent), the adapter folder holds it, generate's tokenizer and the merged
model's tokenizer (as transformers loads the folder) carry it. The control: the same rows without the key are
rendered through the builtin template.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_qlora.config.load import load_config
from moe_qlora.config.sections import ConfigError
from moe_qlora.model.build import CHAT_TEMPLATE_FILE, load_tokenizer

from helpers.crash import isolated_env

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[[assistant]] {% endif %}"
)
ROWS = [{"role": "user", "content": "First letter of basket?"}, {"role": "assistant", "content": "b"}]


def config_with_template(tmp_path: Path, template: Path | None) -> Path:
    lines = [
        "model: {name_or_path: builtin:tiny-mixtral}",
        f"data: {{train_files: [{ROOT / 'data' / 'demo_chat.jsonl'}], max_seq_len: 128}}",
        "lora: {rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}",
        "train: {max_steps: 2, micro_batch_size: 4, lr: 1.0e-3, warmup_steps: 0}",
        f"output: {{dir: {tmp_path / 'run'}}}",
    ]
    if template is not None:
        lines[0] = f"model: {{name_or_path: builtin:tiny-mixtral, chat_template: {template.name}}}"
    path = tmp_path / "cfg.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_template_renders_the_rows_and_travels_with_the_adapter(tmp_path, tmp_path_factory):
    template = tmp_path / "mine.jinja"
    template.write_text(TEMPLATE)
    cfg = load_config(config_with_template(tmp_path, template))
    assert cfg.model.chat_template == str(template)  # relative to the config file
    _, tokenizer = load_tokenizer(cfg.model)
    rendered = tokenizer.apply_chat_template(ROWS, tokenize=False)
    assert rendered.startswith("[[user]] First letter of basket?")
    _, builtin = load_tokenizer(load_config(config_with_template(tmp_path / "..", None)).model)
    assert "[[user]]" not in builtin.apply_chat_template(ROWS, tokenize=False)  # the control

    env = isolated_env(tmp_path_factory)
    cmd = [sys.executable, "-m", "moe_qlora", "train", "--config", str(tmp_path / "cfg.yaml")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = tmp_path / "run" / "adapter"
    assert (adapter / CHAT_TEMPLATE_FILE).read_text() == TEMPLATE

    from moe_qlora.inference.generate import policy_sections_for

    model_cfg, _ = policy_sections_for(adapter, device="cpu", kernels="torch")
    assert load_tokenizer(model_cfg)[1].chat_template == TEMPLATE

    merged = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_qlora", "merge", str(adapter), "--out", str(merged), "--dtype", "float32"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(merged).chat_template == TEMPLATE


@pytest.mark.parametrize(("content", "message"), [(None, "not a readable Jinja template"), ("  \n", "is empty")])
def test_a_missing_or_empty_template_is_one_sentence(tmp_path, content, message):
    template = tmp_path / "mine.jinja"
    if content is not None:
        template.write_text(content)
    cfg = load_config(config_with_template(tmp_path, template))
    with pytest.raises(ConfigError, match=f"model.chat_template: .*{message}"):
        load_tokenizer(cfg.model)
