"""User errors as docs/troubleshooting.md promises them (issue 44): one sentence after `error:`, the exit code, no
traceback, and nothing left behind. Folders the filesystem will not write are provoked for real: a file where the
folder should be (always), a read-only tmpfs (where this user may mount one: CI runs as root), and a folder this
user may not write (chmod, or as root a process running as `nobody`, since root writes through any mode)."""

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.load import load_config
from moe_qlora.config.sections import ConfigError, LoraSection
from moe_qlora.train.checkpoint import check_same_run
from moe_qlora.train.run_identity import config_identity

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "demo_sft.jsonl"
NOBODY = 65534


def cli(*args, env: dict | None = None, prefix: tuple = ()) -> subprocess.CompletedProcess:
    """`python -m moe_qlora ARGS` in a fresh process, as a user runs it (so a traceback would show)."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "moe_qlora", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def one_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one `error:` sentence of a failed command (whitespace joined), after checking its exit code and that
    nothing else of an error (a traceback, a library's own log line) was printed."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return " ".join(proc.stderr[proc.stderr.index("error:") :].split())


@pytest.fixture(scope="module")
def adapter(tiny_mixtral_dir, tmp_path_factory):
    """An adapter of the tiny Mixtral (experts, q and v), as a run writes it."""
    from moe_qlora.export.adapter import save_adapter
    from moe_qlora.model.adapters import attach_adapters
    from moe_qlora.model.loading import LoadOptions, load_model

    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every factor non-zero, as after training: a healthy adapter for check-norms
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    out = tmp_path_factory.mktemp("run") / "adapter"
    return save_adapter(model, out, cfg=lora, base_model_name_or_path=str(tiny_mixtral_dir))


# ------------------------------------------------------------------------------ export / merge: unwritable


WRITES = {
    "gguf": ("export", "--format", "gguf", "--out"),
    "vllm": ("export", "--format", "vllm", "--out"),
    "merge": ("merge", "--out"),
}


def write_args(adapter: Path, kind: str, folder: Path) -> list[str]:
    command, *options = WRITES[kind]
    return [command, str(adapter), *options, str(folder / ("a.gguf" if kind == "gguf" else "x"))]


def refused_in_process(args: list[str]) -> tuple[str, str]:
    """(the one `error:` sentence, all output) of a command run in this process. CliRunner keeps a traceback
    from showing, so the exception must be the exit itself, with code 2, and one error printed."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.count("error:") == 1
    return " ".join(result.output[result.output.index("error:") :].split()), result.output


@pytest.mark.parametrize("kind", list(WRITES))
def test_a_file_where_the_folder_should_be_is_named(adapter, tmp_path, kind):
    (tmp_path / "taken").write_text("a file")
    out = tmp_path / "taken" / ("a.gguf" if kind == "gguf" else "x")
    err, _ = refused_in_process(write_args(adapter, kind, tmp_path / "taken"))
    assert err == f"error: cannot write {out}: {tmp_path / 'taken'} is a file, not a folder"


def test_the_same_from_the_console_entry_point_prints_no_traceback(adapter, tmp_path):
    (tmp_path / "taken").write_text("a file")
    err = one_error(cli(*write_args(adapter, "gguf", tmp_path / "taken")))
    assert err == f"error: cannot write {tmp_path / 'taken' / 'a.gguf'}: {tmp_path / 'taken'} is a file, not a folder"


@pytest.fixture
def read_only_mount(tmp_path):
    """A read-only tmpfs (as root), or a skip where mounting is not allowed."""
    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); the file-in-the-way case stands")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("kind", list(WRITES))
def test_a_read_only_file_system_is_named(adapter, read_only_mount, kind):
    err, _ = refused_in_process(write_args(adapter, kind, read_only_mount))
    assert err.startswith(f"error: cannot write {read_only_mount}/")
    assert err.endswith(f": {read_only_mount} is on a read-only file system")


@pytest.fixture
def locked_folder():
    """A folder of mode 0555 in a folder every user may enter (pytest's own are root's alone), and the command
    prefix that runs a process whom that mode binds: none when this is not root; as root (who writes through
    any mode) setpriv to `nobody`. A skip where neither is possible."""
    prefix = ()
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root writes through any folder mode, and setpriv is not here to drop to nobody")
        prefix = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    base = Path(tempfile.mkdtemp())
    base.chmod(0o755)
    (base / "locked").mkdir(mode=0o555)
    try:
        yield base / "locked", prefix
    finally:
        shutil.rmtree(base)


def test_a_folder_this_user_may_not_write_is_named(adapter, locked_folder):
    """Checked before the adapter is read, so that `nobody` needs to read nothing but this checkout."""
    locked, prefix = locked_folder
    probe = subprocess.run([*prefix, sys.executable, "-c", "import moe_qlora"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"the unprivileged user cannot run this checkout: {probe.stderr[-300:]!r}")
    err = one_error(cli(*write_args(adapter, "gguf", locked), prefix=prefix))
    assert err == f"error: cannot write {locked / 'a.gguf'}: this user may not write in {locked} (permission denied)"


def test_check_writable_creates_nothing(tmp_path):
    """The probe before an export or a merge leaves the folder as it found it, missing parents not made."""
    from moe_qlora.common.fileio import check_writable

    check_writable(tmp_path / "new" / "deeper" / "a.gguf")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ export: --out and --force


def test_export_and_merge_into_a_live_runs_folder_are_refused(adapter, tmp_path):
    """The run writing beside this adapter still holds its folder's lock (another process here): export and
    merge into it are refused with the holder's PID, exit 2, and write nothing; elsewhere they are not."""
    import subprocess
    import sys

    hold = (
        "import sys, time; from moe_qlora.common.lock import RunLock; RunLock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", hold, str(adapter.parent)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        runner, target = CliRunner(), adapter.with_name("locked.gguf")
        result = runner.invoke(app, ["export", str(adapter), "--format", "gguf", "--out", str(target)])
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and f"is in use by another moe-qlora process (PID {proc.pid})" in message
        assert not target.exists()
        merged = runner.invoke(app, ["merge", str(adapter), "--out", str(adapter.with_name("merged"))])
        assert merged.exit_code == 2 and f"(PID {proc.pid})" in " ".join(merged.output.split())
        assert not adapter.with_name("merged").exists()
        elsewhere = runner.invoke(app, ["export", str(adapter), "--format", "gguf", "--out", str(tmp_path / "a.gguf")])
        assert elsewhere.exit_code == 0, elsewhere.output  # control: outside the run nothing is locked
    finally:
        proc.kill()
        proc.wait()


def test_export_writes_beside_the_adapter_and_replaces_only_with_force(adapter):
    runner, gguf = CliRunner(), adapter.with_name("adapter.gguf")
    result = runner.invoke(app, ["export", str(adapter), "--format", "gguf"])
    assert result.exit_code == 0 and f"gguf: {gguf}" in result.output and gguf.stat().st_size > 0
    before = gguf.stat().st_ino
    again = runner.invoke(app, ["export", str(adapter), "--format", "gguf"])
    assert again.exit_code == 2 and again.exception is not None and isinstance(again.exception, SystemExit)
    assert f"error: {gguf} already exists; pass --force to replace it" in " ".join(again.output.split())
    assert gguf.stat().st_ino == before  # untouched
    forced = runner.invoke(app, ["export", str(adapter), "--format", "gguf", "--force"])
    assert forced.exit_code == 0, forced.output
    assert gguf.stat().st_ino != before  # a new file renamed over the old one, not rewritten in place
    assert not [p for p in adapter.parent.iterdir() if ".tmp-" in p.name]
    vllm = runner.invoke(app, ["export", str(adapter), "--format", "vllm"])
    assert vllm.exit_code == 0 and (adapter.with_name("adapter-vllm") / "adapter_config.json").is_file()
    wrong = runner.invoke(app, ["export", str(adapter), "--format", "vllm", "--out", str(gguf), "--force"])
    assert wrong.exit_code == 2 and f"{gguf} is a file, and --format vllm writes a folder" in " ".join(
        wrong.output.split()
    )


def test_merge_and_export_never_replace_what_they_did_not_write_unless_forced(adapter, tmp_path):
    """`merge --out DIR` emptied DIR (exit 0, no --force asked): a folder holding a file of the user's is refused
    without --force, the file kept; the folder holding the adapter is refused even with it (by merge and export),
    nothing of it touched; an empty folder is written into; --force replaces a folder's contents."""
    runner = CliRunner()
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("keep me")
    refused = runner.invoke(app, ["merge", str(adapter), "--out", str(notes.parent)])
    message = " ".join(refused.output.split())
    assert refused.exit_code == 2 and f"error: {notes.parent} is a folder that is not empty; pass --force" in message
    assert notes.read_text() == "keep me"
    run = adapter.parent
    before = sorted(p.name for p in run.iterdir())
    for args in (["merge", str(adapter)], ["export", str(adapter), "--format", "vllm"]):
        held = runner.invoke(app, [*args, "--out", str(run), "--force"])
        assert held.exit_code == 2 and f"{run} holds the adapter" in " ".join(held.output.split()), held.output
    assert sorted(p.name for p in run.iterdir()) == before and (adapter / "adapter_model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    merged = runner.invoke(app, ["merge", str(adapter), "--out", str(empty)])
    assert merged.exit_code == 0 and (empty / "config.json").is_file(), merged.output
    forced = runner.invoke(app, ["merge", str(adapter), "--out", str(notes.parent), "--force"])
    assert forced.exit_code == 0 and not notes.exists() and (notes.parent / "config.json").is_file(), forced.output


def test_weights_are_written_with_the_mode_the_umask_gives(adapter, tmp_path):
    """safetensors creates its files 0600 whatever the umask: a server running as another user got "Permission
    denied" on a merged model. Every weight file moe-qlora writes gets what open() gives (0666 less the umask)."""
    from safetensors.torch import save_file

    from moe_qlora.common.fileio import save_safetensors

    old = os.umask(0o022)
    try:
        runner = CliRunner()
        assert runner.invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "merged")]).exit_code == 0
        out = tmp_path / "per-expert"
        assert runner.invoke(app, ["export", str(adapter), "--format", "per-expert", "--out", str(out)]).exit_code == 0
        weights = [adapter / "adapter_model.safetensors", out / "adapter_model.safetensors"]
        weights += sorted((tmp_path / "merged").glob("*.safetensors"))
        assert len(weights) >= 3 and {f.stat().st_mode & 0o777 for f in weights} == {0o644}, weights
        save_file({"a": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))  # broken control: safetensors' own
        assert (tmp_path / "plain.safetensors").stat().st_mode & 0o777 == 0o600
        os.umask(0o027)
        save_safetensors({"a": torch.zeros(1)}, tmp_path / "private.safetensors")
        assert (tmp_path / "private.safetensors").stat().st_mode & 0o777 == 0o640  # a stricter umask is honoured
    finally:
        os.umask(old)


# ------------------------------------------------------------------------------ train: model folder and data


def config_file(tmp_path: Path, model: str, data: Path = DATA) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"model: {{name_or_path: '{model}'}}\ndata: {{train_files: ['{data}'], max_seq_len: 48}}\n"
        f"train: {{max_steps: 1}}\noutput: {{dir: '{tmp_path / 'runs' / 'out'}'}}\n"
    )
    return path


def model_folder(tmp_path: Path, source: Path, *names: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in names:
        shutil.copy(source / name, folder / name)
    return folder


NO_TOKENIZER = "no tokenizer files (tokenizer.json, tokenizer.model or vocab.json: save the tokenizer beside the model)"
NO_WEIGHTS = "no weight files (*.safetensors; .bin weights are not read)"


def test_a_model_folder_of_config_json_alone_is_named_before_the_data_is_read(tiny_mixtral_dir, tmp_path):
    folder = model_folder(tmp_path, tiny_mixtral_dir, "config.json")
    proc = cli("train", "--config", config_file(tmp_path, str(folder)))
    assert one_error(proc) == f"error: model path '{folder}' has {NO_TOKENIZER} and {NO_WEIGHTS}"
    assert "data:" not in proc.stdout  # refused before any row was read
    assert not (tmp_path / "runs").exists()  # and no empty run folder (nor the parent it made) left behind


def test_a_model_folder_without_weights_is_named_not_blamed_on_the_data(tiny_mixtral_dir, tmp_path):
    folder = model_folder(tmp_path, tiny_mixtral_dir, "config.json", "tokenizer.json", "tokenizer_config.json")
    err, output = refused_in_process(["train", "--config", str(config_file(tmp_path, str(folder)))])
    assert err == f"error: model path '{folder}' has {NO_WEIGHTS}"
    assert "data:" not in output and "no trainable rows" not in output
    assert not (tmp_path / "runs").exists()


def test_an_empty_data_file_is_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    cfg = config_file(tmp_path, "builtin:tiny-mixtral", tmp_path / "empty.jsonl")
    err, _ = refused_in_process(["train", "--config", str(cfg)])
    assert err == f"error: data.train_files: {tmp_path / 'empty.jsonl'}: the file is empty: it holds no rows"
    assert not (tmp_path / "runs").exists()


def test_a_malformed_line_is_named_once_by_its_line_and_no_run_folder_is_left(tmp_path):
    """datasets logs pyarrow's own failure first ("in row 5", counted from 0): held back; the line is the file's,
    counted from 1 as an editor does."""
    lines = DATA.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:5], '{"prompt": "x" "completion": "y"}', *lines[5:9]]) + "\n")
    proc = cli("train", "--config", config_file(tmp_path, "builtin:tiny-mixtral", bad))
    assert one_error(proc) == f"error: {bad}:6: not valid JSON (Expecting ',' delimiter)"
    assert "row" not in proc.stderr and "pyarrow" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_only_an_unused_folder_this_run_created_is_removed(tmp_path):
    from moe_qlora.common.fileio import removed_if_left_unused
    from moe_qlora.common.lock import LOCK_NAME, RunLock

    def refused(folder: Path, leave: str | None = None) -> None:
        with pytest.raises(ConfigError), removed_if_left_unused(folder):
            RunLock.acquire(folder).release()  # what a run does first: its lock file is left in the folder
            if leave:
                (folder / leave).write_text("x")
            raise ConfigError("refused")

    refused(tmp_path / "new" / "run")
    assert list(tmp_path.iterdir()) == []  # the run folder and the parent it made
    (tmp_path / "there").mkdir()
    refused(tmp_path / "there")
    assert [p.name for p in (tmp_path / "there").iterdir()] == [LOCK_NAME]  # not this run's to remove
    refused(tmp_path / "wrote", leave="metrics.jsonl")
    assert (tmp_path / "wrote" / "metrics.jsonl").exists()  # holds something: kept
    with removed_if_left_unused(tmp_path / "ok"):
        (tmp_path / "ok").mkdir()
    assert (tmp_path / "ok").is_dir()  # a run that did not fail keeps its folder, empty or not


# ------------------------------------------------------------------------------ config and resume


def test_a_bad_set_value_is_blamed_on_the_set(tmp_path):
    path = config_file(tmp_path, "builtin:tiny-mixtral")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.lr=abc", "lora.rank=-1", "train.learning_rate=3"])
    message = str(info.value)
    assert "--set train.lr=abc: train.lr: Input should be a valid number" in message
    assert "--set lora.rank=-1: lora.rank: Input should be greater than or equal to 1 (got -1)" in message
    assert "--set train.learning_rate=3: unknown key 'train.learning_rate'; did you mean 'train.lr'?" in message
    assert f"{path}:" not in message  # the config file's lines are not the culprit
    path.write_text(path.read_text().replace("max_steps: 1", "max_steps: -1"))
    with pytest.raises(ConfigError, match=rf"{path}:3: train.max_steps"):  # a key the file gave: its line
        load_config(path, ["train.lr=1e-4"])


def test_a_refused_resume_names_the_keys_that_changed(tmp_path):
    old = load_config(config_file(tmp_path, "builtin:tiny-mixtral")).model_dump(mode="json")
    new = json.loads(json.dumps(old))
    new["train"]["lr"], new["lora"]["rank"] = 1e-3, 16
    state = config_identity(old) | {"dataset_fingerprint": "d"}
    with pytest.raises(
        Exception,
        match=r"the configuration differs from the one this checkpoint was trained with "
        r"\(lora.rank 8 -> 16, train.lr 0.0002 -> 0.001\); resuming would not",
    ):
        check_same_run(tmp_path, state, config_identity(new) | {"dataset_fingerprint": "d"})
    for k in ("epochs", "seed", "warmup_steps"):
        new["train"][k] = 99
    with pytest.raises(Exception, match=r" -> 99 and 1 more\);"):  # the first 4, then how many more
        check_same_run(tmp_path, state, config_identity(new) | {"dataset_fingerprint": "d"})
    legacy = {"config_hash": state["config_hash"], "dataset_fingerprint": "d"}  # written before configs were kept
    with pytest.raises(Exception, match=r"trained with; resuming"):
        check_same_run(tmp_path, legacy, config_identity(new) | {"dataset_fingerprint": "d"})
    check_same_run(tmp_path, state, config_identity(old) | {"dataset_fingerprint": "d"})  # the same run: no error


# ------------------------------------------------------------------------------ plots and check-norms


def figures_of(monkeypatch, records: list[dict], tmp_path: Path) -> dict:
    """{png name: the matplotlib figure plot_run drew for it}."""
    from moe_qlora.cli import plots

    drawn = {}
    monkeypatch.setattr(plots, "save", lambda fig, path: drawn.__setitem__(path.name, fig))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plots.plot_run(tmp_path)
    return drawn


def test_kl_of_a_run_without_kl_says_so_and_router_load_ticks_whole_layers(monkeypatch, tmp_path):
    load = [[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]]  # 3 layers: matplotlib would tick 0, 0.5, 1, ...
    records = [
        {
            "step": s,
            "lr": 1e-3,
            "grad_norm": 0.5,
            "reward_mean": s / 10,
            "router_load": load,
            "completion_tokens": {"mean": 5.0},
        }
        for s in range(1, 4)
    ]
    drawn = figures_of(monkeypatch, records, tmp_path)
    texts = [t.get_text() for t in drawn["kl.png"].axes[0].texts]
    assert texts == ["KL not computed: grpo.kl_coef is 0 (no KL term), so the run logged none"]
    assert not drawn["reward.png"].axes[0].texts  # a plot with its line has no note
    heat = drawn["router_load.png"].axes[0]
    assert [t for t in heat.get_yticks() if -0.5 <= t <= 2.5] == [0, 1, 2]
    assert all(float(t).is_integer() for t in heat.get_xticks())


def table_rows_fit_80(output: str, names: dict[str, tuple[str, str]]) -> None:
    """Every line of the table within 80 columns, and each module's layer and name whole on one line."""
    table = [line for line in output.splitlines() if not line.startswith("LoRA norms:")]  # (the title holds the
    # adapter's path, of any length)
    assert max(map(len, table)) <= 80, output
    starts = [line.split()[:2] for line in table if line.strip()]
    for layer, name in names.values():
        assert [layer, name] in starts, name


def test_check_norms_fits_80_columns_without_breaking_a_module_name(adapter):
    from rich.console import Console

    from moe_qlora.export.norms import check_norms, render_table, split_layers

    report = check_norms(adapter)
    _, names = split_layers([r.module for r in report.rows])
    assert set(names.values()) >= {("0", "mlp.experts.gate_up_proj"), ("1", "self_attn.v_proj")}
    proc = cli("check-norms", adapter, env={"COLUMNS": "80"})  # the summary, as a terminal 80 wide shows it
    assert proc.returncode == 0, proc.stderr
    table_rows_fit_80(proc.stdout, names)
    console = Console(width=80, soft_wrap=True, file=io.StringIO())  # what COLUMNS=80 gives the CLI's console
    render_table(report, console)  # --per-expert
    table_rows_fit_80(console.file.getvalue(), names)


def test_plot_into_a_path_under_a_file_is_one_sentence(monkeypatch, capsys, tmp_path):
    """`plot` catches only its own errors; the console entry point turns a refused write into the sentence."""
    from moe_qlora.cli.app import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.001, "grad_norm": 1.0}\n')
    (tmp_path / "taken").write_text("a file")
    monkeypatch.setattr(sys, "argv", ["moe-qlora", "plot", str(tmp_path), "--out", str(tmp_path / "taken" / "p")])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err == f"error: cannot write {tmp_path / 'taken' / 'p'}: {tmp_path / 'taken'} is a file, not a folder"


def test_the_next_commands_stay_one_line_at_80_columns(tmp_path):
    """At the end of a run, the suggested commands wrapped mid-command at 80 columns (issue 62): each is one line
    now, however long the adapter's path, so it copies whole."""
    from rich.console import Console

    from moe_qlora.train.runs import RunSummary

    adapter = tmp_path / "a-run-folder-with-a-long-descriptive-name-as-people-give-them" / "adapter"
    summary = RunSummary("train", 210, 19.0, 48_000, 0.22, 0.19, adapter, adapter.parent / "metrics.jsonl")
    console = Console(width=80, file=io.StringIO())
    summary.print(console)
    lines = console.file.getvalue().splitlines()
    commands = [line for line in lines if line.lstrip().startswith("moe-qlora ")]
    assert len(commands) == 3 and all(str(adapter) in line for line in commands), lines
    assert f"adapter: {adapter}" in lines
    assert max(len(line) for line in commands) > 80  # the control: these lines would not fit otherwise


def test_a_sections_check_names_the_set_values_inside_it(tmp_path):
    """A check of several keys together failed on --set values blamed the file's section alone (issue 62): the
    --set values inside the section are named beside its line, and the section is not printed whole."""
    path = config_file(tmp_path, "builtin:tiny-mixtral")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["dpo.loss_type=aot", "dpo.use_weighting=true"])
    message = " ".join(str(info.value).split())
    assert "with --set dpo.loss_type=aot with --set dpo.use_weighting=true: dpo:" in message, message
    assert "sorts the pairs" in message and "DpoSection(" not in message


@pytest.mark.parametrize(
    ("key", "message"),
    [("use_rslora", r"set lora\.alpha to alpha x sqrt\(rank\)"), ("use_dora", "DoRA is not supported")],
)
def test_peft_lora_variants_are_refused_by_name_with_what_to_do(tmp_path, key, message):
    """rsLoRA and DoRA (PEFT's) are named, not reported as unknown keys; false is accepted and means nothing."""
    path = config_file(tmp_path, "builtin:tiny-mixtral")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [f"lora.{key}=true"])
    assert load_config(path, [f"lora.{key}=false"]).lora.rank == 8
