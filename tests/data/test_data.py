"""Row formats, loss masks, truncation accounting, the seeded epoch order, and clear data errors."""

import json

import pytest

from moe_qlora.config.sections import DataSection
from moe_qlora.data.examples import IGNORE, DataStats, build_examples, epoch_order, tokenize_row
from moe_qlora.data.sources import DataError
from moe_qlora.model.tiny import build_byte_tokenizer

TOK = build_byte_tokenizer()


def cfg(**kw):
    return DataSection(train_files=["unused.jsonl"], **kw)


def targets(example):
    return TOK.decode([t for t in example.labels if t != IGNORE])


def row(data, **kw):
    return tokenize_row(data, TOK, cfg(**kw), "f.jsonl:1", DataStats())


@pytest.mark.parametrize("key", ["completion", "response"])
def test_prompt_completion_trains_on_completion_and_eos_only(key):
    ex = row({"prompt": "Q: 2+2\n", key: "4"})
    assert TOK.decode(ex.input_ids) == "Q: 2+2\n4<|eos|>"
    assert targets(ex) == "4<|eos|>"


def test_train_on_prompt_keeps_every_label():
    ex = row({"prompt": "Q: 2+2\n", "completion": "4"}, train_on_prompt=True)
    assert ex.labels == ex.input_ids


MESSAGES = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "two"},
    ]
}


def test_messages_train_on_last_assistant_turn_only():
    ex = row(MESSAGES)
    assert targets(ex) == "two<|end|>"
    assert TOK.decode(ex.input_ids).startswith("<|user|>hi<|end|><|assistant|>one")


def test_messages_all_assistant_turns_when_asked():
    assert targets(row(MESSAGES, all_assistant_turns=True)) == "one<|end|>two<|end|>"


def test_text_rows_train_on_everything():
    ex = row({"text": "hello"})
    assert targets(ex) == "hello<|eos|>"


def test_truncation_is_counted_and_fully_masked_rows_are_dropped():
    stats = DataStats()
    c = cfg(max_seq_len=10)
    kept = tokenize_row({"prompt": "ab", "completion": "cdefghijklmn"}, TOK, c, "f:1", stats)
    dropped = tokenize_row({"prompt": "a" * 20, "completion": "b"}, TOK, c, "f:2", stats)
    assert len(kept.input_ids) == 10 and dropped is None
    assert (stats.truncated, stats.dropped_no_target) == (2, 1)
    stats = DataStats()
    assert (
        tokenize_row({"prompt": "a" * 20, "completion": "b"}, TOK, cfg(max_seq_len=10, overlength="drop"), "f:3", stats)
        is None
    )
    assert stats.dropped_overlength == 1


def test_rows_whose_targets_truncation_cut_away_say_so_with_the_length_that_keeps_them(tmp_path):
    """A 76-token chat row at max_seq_len 64 used to read "0 over max_seq_len ... 16 with no target left", as if
    the rows had no targets: the truncation cut them, and the message says so with the length that keeps one."""
    rows = tmp_path / "long.jsonl"
    turn = {"messages": [{"role": "user", "content": "w" * 100}, {"role": "assistant", "content": "yes"}]}
    rows.write_text((json.dumps(turn) + "\n") * 16)
    first = next(i for i, t in enumerate(row(turn).labels) if i > 0 and t != IGNORE)
    with pytest.raises(DataError) as info:
        build_examples(DataSection(train_files=[str(rows)], max_seq_len=64), TOK)
    said = str(info.value)
    assert "16 with no target left, 16 of them because truncating to data.max_seq_len 64 cut away every" in said
    assert f"data.max_seq_len {first + 1} or more keeps at least one" in said
    kept, stats = build_examples(DataSection(train_files=[str(rows)], max_seq_len=first + 1), TOK)
    assert len(kept) == 16 and stats.cut_to_no_target == 0  # the length it names is enough
    with pytest.raises(DataError, match="16 of them because truncating"):  # and one token less is not
        build_examples(DataSection(train_files=[str(rows)], max_seq_len=first), TOK)


def test_a_file_of_empty_rows_says_what_a_row_needs(tmp_path):
    """datasets' own words were 'Instruction "train" corresponds to no data!'."""
    rows = tmp_path / "empty-rows.jsonl"
    rows.write_text("{}\n")
    with pytest.raises(DataError, match=r"empty-rows.jsonl:1: an empty row \(\{\}\); a row needs 'text', or 'prompt'"):
        build_examples(DataSection(train_files=[str(rows)]), TOK)


def test_epoch_order_is_seeded_and_changes_every_epoch():
    assert epoch_order(50, seed=1, epoch=0) == epoch_order(50, seed=1, epoch=0)
    assert epoch_order(50, seed=1, epoch=0) != epoch_order(50, seed=1, epoch=1)
    assert epoch_order(50, seed=1, epoch=0) != epoch_order(50, seed=2, epoch=0)
    assert sorted(epoch_order(50, seed=1, epoch=3)) == list(range(50))


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"prompt": "x"}, "cannot tell the row format"),
        ({"prompt": "x", "completion": "  "}, "empty 'completion'"),
        ({"prompt": 3, "completion": "y"}, "'prompt' must be a string"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\] must have role"),
    ],
)
def test_bad_rows_are_refused_naming_the_row(bad, message):
    with pytest.raises(DataError, match=message) as err:
        row(bad)
    assert "f.jsonl:1" in str(err.value)


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        build_examples(DataSection(train_files=[str(path)]), TOK)


def test_files_load_through_datasets_with_row_sources(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) + "\n" for i in range(3)))
    examples, stats = build_examples(DataSection(train_files=[str(path)]), TOK)
    assert [e.source for e in examples] == [f"{path}:{i}" for i in (1, 2, 3)]
    assert stats.formats == {"prompt_completion": 3}


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_json_array_and_parquet_files_load_too(tmp_path, suffix):
    import datasets

    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(4)]
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    examples, _ = build_examples(DataSection(train_files=[str(path)]), TOK)
    assert [targets(e) for e in examples] == [f"c{i}<|eos|>" for i in range(4)]


def test_unsupported_file_type_is_refused(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '.csv'"):
        build_examples(DataSection(train_files=[str(path)]), TOK)


def test_overlength_error_names_the_row():
    with pytest.raises(DataError, match=r"f.jsonl:1: \d+ tokens, over data.max_seq_len 10"):
        row({"prompt": "a" * 20, "completion": "b"}, max_seq_len=10, overlength="error")


@pytest.mark.parametrize(
    "roles,problem",
    [
        (["user", "system", "assistant"], "system turn after the first"),
        (["assistant", "user", "assistant"], "assistant turn with no user turn"),
        (["user", "user", "assistant"], "two user turns in a row"),
        (["user", "tool", "assistant"], "tool turn that answers no assistant"),
    ],
)
def test_roles_out_of_order_are_refused(roles, problem):
    messages = [{"role": r, "content": "x"} for r in roles]
    with pytest.raises(DataError, match=problem):
        row({"messages": messages})


def test_too_many_dropped_rows_stop_the_run(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "p" * 40, "completion": "c"}] * 3 + [{"prompt": "p", "completion": "c"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"3 of 4 rows dropped .* over data.max_dropped_share 0.5"):
        build_examples(DataSection(train_files=[str(path)], max_seq_len=16, overlength="drop"), TOK)
