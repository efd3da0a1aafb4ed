"""Preference rows in TRL's formats (strings, conversational, implicit prompt; files, save_to_disk folders and hub
ids from the offline cache) to pairs: labels on the completion only, the prompt shared, overlength as
data.overlength says, and malformed rows named by file and line."""

import json

import datasets
import pytest
from data.test_datasources import fill_offline_cache, run_offline

from moe_qlora.config.sections import DataSection
from moe_qlora.data.examples import IGNORE
from moe_qlora.data.preference import build_pairs, extract_prompt
from moe_qlora.data.sources import DataError
from moe_qlora.model.tiny import build_byte_tokenizer

TOK = build_byte_tokenizer()


def pairs_of(tmp_path, rows, **data):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_pairs(DataSection(train_files=[str(path)], **data), TOK)


def text(ids) -> str:
    return TOK.decode(ids, skip_special_tokens=False)


def target(example) -> str:
    return TOK.decode([t for t in example.labels if t != IGNORE], skip_special_tokens=True)


def prompt_part(example) -> list[int]:
    return [t for t, label in zip(example.input_ids, example.labels, strict=True) if label == IGNORE]


def test_strings_label_only_the_completions_and_share_the_prompt(tmp_path):
    (pair,), stats = pairs_of(tmp_path, [{"prompt": "Upper: cat\n", "chosen": "CAT", "rejected": "cat"}])
    assert target(pair.chosen) == "CAT" and target(pair.rejected) == "cat"
    assert prompt_part(pair.chosen) == prompt_part(pair.rejected)
    assert text(prompt_part(pair.chosen)).endswith("Upper: cat\n")
    assert pair.chosen.input_ids[-1] == TOK.eos_token_id == pair.chosen.labels[-1]  # the answer ends
    assert pair.source.endswith("pairs.jsonl:1") and pair.index == 0 and stats.formats == {"strings": 1}


def test_conversational_rows_go_through_the_chat_template(tmp_path):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Shout cat"}]
    row = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "CAT"}],
        "rejected": [{"role": "assistant", "content": "cat"}],
    }
    (pair,), stats = pairs_of(tmp_path, [row])
    whole = TOK.apply_chat_template(prompt + row["chosen"], tokenize=True)
    head = TOK.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    whole, head = (list(x["input_ids"] if not isinstance(x, list) else x) for x in (whole, head))
    assert pair.chosen.input_ids == whole  # TRL's rule: the completion is what follows the prompt's render
    assert pair.chosen.labels == [IGNORE] * len(head) + whole[len(head) :]
    assert "CAT" in target(pair.chosen) and "cat" in target(pair.rejected) and "Shout" not in target(pair.chosen)
    assert stats.formats == {"conversational": 1}


def test_the_implicit_prompt_is_the_shared_beginning():
    assert extract_prompt("Q: hi A: yes", "Q: hi A: no") == ("Q: hi A:", " yes", " no")  # the space goes along
    user = {"role": "user", "content": "hi"}
    yes, no = {"role": "assistant", "content": "yes"}, {"role": "assistant", "content": "no"}
    assert extract_prompt([user, yes], [user, no]) == ([user], [yes], [no])


def test_a_string_prompt_beside_conversations_is_set_aside_as_trl_does(tmp_path):
    """HuggingFaceH4/ultrafeedback_binarized's shape: `prompt` a string, chosen / rejected whole conversations
    that hold it; TRL's maybe_extract_prompt takes the prompt from the conversations instead."""
    user = {"role": "user", "content": "Shout cat"}
    up, down = {"role": "assistant", "content": "CAT"}, {"role": "assistant", "content": "cat"}
    mixed, _ = pairs_of(tmp_path, [{"prompt": "Shout cat", "chosen": [user, up], "rejected": [user, down]}])
    explicit, _ = pairs_of(tmp_path, [{"prompt": [user], "chosen": [up], "rejected": [down]}])
    assert mixed[0].chosen == explicit[0].chosen and mixed[0].rejected == explicit[0].rejected


def test_implicit_prompt_rows_make_the_same_pair_as_explicit_ones(tmp_path):
    user = {"role": "user", "content": "Shout cat"}
    up, down = {"role": "assistant", "content": "CAT"}, {"role": "assistant", "content": "cat"}
    implicit, _ = pairs_of(tmp_path, [{"chosen": [user, up], "rejected": [user, down]}])
    explicit, _ = pairs_of(tmp_path, [{"prompt": [user], "chosen": [up], "rejected": [down]}])
    assert implicit[0].chosen == explicit[0].chosen and implicit[0].rejected == explicit[0].rejected
    strings, _ = pairs_of(tmp_path, [{"chosen": "Upper: cat\nCAT", "rejected": "Upper: cat\ncat"}])
    assert target(strings[0].chosen) == "CAT" and text(prompt_part(strings[0].chosen)).endswith("Upper: cat\n")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "p", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, "'chosen' must be a string or a list of messages"),
        (
            {"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
            "must both be strings or both message lists",
        ),
        ({"prompt": "p", "chosen": " ", "rejected": "b"}, "empty 'chosen'"),
        ({"chosen": "abc", "rejected": "xyz"}, "share no beginning"),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "user", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "'chosen' must answer the prompt",
        ),
        (
            {
                "prompt": [{"role": "user"}],
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "prompt[0] must be a {role, content} message",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "the prompt must end with a user turn",
        ),
    ],
)
def test_a_malformed_row_is_named_by_file_and_line(tmp_path, row, expected):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    with pytest.raises(DataError) as info:
        pairs_of(tmp_path, [good, row])
    assert "pairs.jsonl:2" in str(info.value) and expected in str(info.value), str(info.value)


def test_overlength_pairs_are_truncated_dropped_or_refused(tmp_path):
    long = {"prompt": "Q\n", "chosen": "x" * 40, "rejected": "y"}
    rows = [long, {"prompt": "Q\n", "chosen": "a", "rejected": "b"}]
    (cut, _), stats = pairs_of(tmp_path, rows, max_seq_len=16)
    assert len(cut.chosen.input_ids) == 16 and stats.truncated == 1 and len(cut.rejected.input_ids) < 16
    kept, stats = pairs_of(tmp_path, rows, max_seq_len=16, overlength="drop")
    assert len(kept) == 1 and stats.dropped_overlength == 1 and kept[0].index == 0
    with pytest.raises(DataError, match=r"pairs.jsonl:1: \d+ tokens, over data.max_seq_len 16"):
        pairs_of(tmp_path, rows, max_seq_len=16, overlength="error")
    same_start = {"prompt": "Q\n", "chosen": "abcdefghijklmnopqrstuvwxyz", "rejected": "abcdefghijklmnopqrstuvwxyZ"}
    kept, stats = pairs_of(tmp_path, [same_start, *rows[1:]], max_seq_len=16, max_dropped_share=0.9)
    assert len(kept) == 1 and stats.dropped_no_target == 1  # cut to the same tokens, the pair prefers nothing
    no_room = {"prompt": "a very long prompt that fills the window\n", "chosen": "a", "rejected": "b"}
    kept, stats = pairs_of(tmp_path, [no_room, *rows[1:]], max_seq_len=16, max_dropped_share=0.9)
    assert len(kept) == 1 and stats.dropped_no_target == 1  # a prompt that leaves no completion token


def test_save_to_disk_folders_and_hub_ids_are_read(tmp_path):
    rows = [{"prompt": "Upper: cat\n", "chosen": "CAT", "rejected": "cat"}] * 3
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "prefs"))
    pairs, _ = build_pairs(DataSection(train_files=[str(tmp_path / "prefs")]), TOK)
    assert len(pairs) == 3 and target(pairs[2].chosen) == "CAT"
    cache = tmp_path / "cache"
    fill_offline_cache(cache, "someorg/prefs_mini", rows, tmp_path)
    code = (
        "from moe_qlora.config.sections import DataSection\n"
        "from moe_qlora.data.preference import build_pairs\n"
        "from moe_qlora.model.tiny import build_byte_tokenizer\n"
        "pairs, _ = build_pairs(DataSection(train_files=['someorg/prefs_mini']), build_byte_tokenizer())\n"
        "print(len(pairs), pairs[0].source)"
    )
    proc = run_offline(code, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "3 someorg/prefs_mini[train]:1"
