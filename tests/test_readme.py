"""The README's code runs as written: its PEFT snippet loads a trained adapter (a builtin: base included) and
generates; `--version` and `python -m moe_qlora` work."""

import re
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from moe_qlora import __version__
from moe_qlora.config.load import validate_config
from moe_qlora.train import sft as trainer

ROOT = Path(__file__).resolve().parent.parent


def readme_python_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


def test_the_readme_peft_snippet_runs_as_written(tmp_path, capsys):
    cfg = validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "lora": {"rank": 4, "target_modules": ["q_proj"]},
            "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl")], "max_seq_len": 48},
            "train": {"max_steps": 2, "lr": 5e-3, "warmup_steps": 0},
            "output": {"dir": str(tmp_path / "run")},
        }
    )
    trainer.train(cfg, Console(quiet=True))
    code = readme_python_block("PeftModel.from_pretrained")
    assert '"runs/demo/adapter"' in code
    namespace: dict = {}
    exec(code.replace('"runs/demo/adapter"', repr(str(tmp_path / "run" / "adapter"))), namespace)
    assert "Add: 3+5" in capsys.readouterr().out  # it generated and printed
    model = namespace["model"]
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and any(bool(p.detach().abs().sum() > 0) for p in trained.values())  # LoRA landed, trained
    assert any(".experts." in n for n in trained)  # expert LoRA too, not only attention


def test_version_and_python_dash_m():
    entry_point = str(Path(sys.executable).parent / "moe-qlora")  # pyproject's [project.scripts], installed
    for cmd in ([sys.executable, "-m", "moe_qlora", "--version"], [entry_point, "--version"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == f"moe-qlora {__version__}", proc.stderr
    proc = subprocess.run([sys.executable, "-m", "moe_qlora", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "check-norms" in proc.stdout
