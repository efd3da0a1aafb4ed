"""Property-based: whatever rows and configs users write, the loaders give a valid result or our clear error
(DataError / ConfigError, naming the place), never another exception."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import ConfigError, DataSection
from moe_qlora.data.examples import IGNORE, DataStats, tokenize_row
from moe_qlora.data.sources import DataError, load_rows
from moe_qlora.model.tiny import build_byte_tokenizer

TOK = build_byte_tokenizer()
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=30))
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "bot"]), scalars),
        "content": scalars,
    },
)
rows = st.dictionaries(
    st.sampled_from(["prompt", "completion", "response", "text", "messages", "reward", "extra"]),
    st.one_of(scalars, st.lists(message, max_size=5), st.lists(scalars, max_size=3)),
    max_size=5,
)
data_cfg = st.builds(
    DataSection,
    train_files=st.just(["f.jsonl"]),
    format=st.sampled_from(["auto", "prompt_completion", "messages", "text"]),
    train_on_prompt=st.booleans(),
    all_assistant_turns=st.booleans(),
    max_seq_len=st.integers(8, 64),
    overlength=st.sampled_from(["truncate", "drop", "error"]),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=rows, cfg=data_cfg)
def test_any_row_gives_an_example_or_a_data_error_naming_it(row, cfg):
    try:
        ex = tokenize_row(row, TOK, cfg, "f.jsonl:7", DataStats())
    except DataError as exc:
        assert str(exc).startswith("f.jsonl:7: ")
        return
    if ex is not None:
        assert len(ex.input_ids) == len(ex.labels) <= cfg.max_seq_len
        assert any(t != IGNORE for t in ex.labels[1:])


# Each file goes through `datasets` (a cache folder per file): fewer examples, the same property.
FIXTURE_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(lines=st.lists(st.one_of(st.text(max_size=40), rows.map(json.dumps)), min_size=1, max_size=6))
def test_any_jsonl_file_loads_or_names_the_bad_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "d.jsonl"
    path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
    try:
        load_rows([str(path)])
    except DataError as exc:
        assert str(path) in str(exc)


sections = {
    "model": st.fixed_dictionaries(
        {"name_or_path": st.one_of(st.text(max_size=10), scalars)},
        optional={"compute_dtype": scalars, "device": scalars, "bogus": scalars},
    ),
    "lora": st.dictionaries(
        st.sampled_from(["rank", "alpha", "dropout", "experts", "router", "target_modules", "rnk"]),
        st.one_of(scalars, st.lists(st.text(max_size=8), max_size=3)),
    ),
    "data": st.dictionaries(
        st.sampled_from(["train_files", "max_seq_len", "format", "overlength", "formt"]),
        st.one_of(scalars, st.lists(st.text(max_size=8), max_size=2)),
    ),
    "train": st.dictionaries(
        st.sampled_from(
            [
                "lr",
                "epochs",
                "max_steps",
                "warmup_steps",
                "gclip",
                "save_every",
                "nan_policy",
                "betas",
                "schedule",
                "lrr",
                "optimizer",
                "optimizer_in_backward",
                "grad_accum",
                "max_grad_norm",
            ]
        ),
        st.one_of(scalars, st.sampled_from(["adamw", "adamw_8bit", "paged_adamw_8bit"])),
    ),
}


@settings(max_examples=1500, deadline=None)
@given(raw=st.one_of(st.fixed_dictionaries({}, optional=sections), scalars, st.lists(scalars, max_size=2)))
def test_any_config_validates_or_gives_a_config_error(raw):
    try:
        validate_config(raw, source="cfg.yaml")
    except ConfigError as exc:
        assert "cfg.yaml" in str(exc)
