"""Preference data: rows of (prompt, chosen, rejected) in TRL's formats to pairs of masked token sequences.

Formats (TRL's): strings {"prompt", "chosen", "rejected"}; conversational, the prompt a list of messages and
chosen / rejected lists of the messages that answer it (through the chat template); and the implicit prompt,
{"chosen", "rejected"} whole texts or conversations whose shared beginning is the prompt. Each completion is
everything after the prompt, and only it carries labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_qlora.config.sections import DataSection
from moe_qlora.data.examples import IGNORE, DataStats, Example, check_turn_order, token_ids
from moe_qlora.data.sources import DataError, entry_path, load_rows

ANSWER_ROLES = ("assistant", "tool")  # what may follow the prompt in a conversational completion


@dataclass(frozen=True)
class PreferencePair:
    """One preference row: the prompt with its chosen and with its rejected completion, (L,) each, labels only
    on the completion. `index`: the pair's place among the run's pairs (training files, then eval files), the
    key of its reference log-probabilities."""

    chosen: Example
    rejected: Example
    source: str
    index: int


def extract_prompt(chosen, rejected):
    """TRL's implicit prompt: the longest shared beginning of chosen and rejected (messages, or characters; a
    space right before the split goes with the completions). Returns (prompt, chosen, rejected)."""
    end = 0
    while end < min(len(chosen), len(rejected)) and chosen[end] == rejected[end]:
        end += 1
    if isinstance(chosen, str) and end and chosen[end - 1] == " ":
        end -= 1
    return chosen[:end], chosen[end:], rejected[end:]


def split_row(row: dict, source: str) -> tuple[object, object, object]:
    """(prompt, chosen, rejected) of a row, strings or message lists all three; an implicit prompt extracted."""
    for key in ("chosen", "rejected"):
        if row.get(key) is None:
            raise DataError(
                f"{source}: a preference row needs 'chosen' and 'rejected' (and usually 'prompt'); "
                f"the row has {sorted(k for k, v in row.items() if v is not None)}"
            )
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if prompt is not None and isinstance(prompt, list) != isinstance(chosen, list):
        # As TRL's maybe_extract_prompt: a prompt of the other kind than the completions (a string beside whole
        # conversations, as in HuggingFaceH4/ultrafeedback_binarized) is set aside and the prompt extracted.
        prompt = None
    if prompt is None:
        if type(chosen) is not type(rejected):
            raise DataError(f"{source}: 'chosen' and 'rejected' must both be strings or both message lists")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if not prompt:
            raise DataError(f"{source}: no 'prompt', and 'chosen' and 'rejected' share no beginning to take as one")
    kinds = {
        key: _kind(value, key, source)
        for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))
    }
    if len(set(kinds.values())) > 1:
        raise DataError(
            f"{source}: prompt, chosen and rejected must be all strings or all message lists; got "
            + ", ".join(f"{k} {v}" for k, v in kinds.items())
        )
    return prompt, chosen, rejected


def _kind(value, key: str, source: str) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "messages"
    raise DataError(f"{source}: {key!r} must be a string or a list of messages, got {type(value).__name__}")


def tokenize_strings(prompt: str, completion: str, tokenizer, key: str, source: str) -> tuple[list[int], list[int]]:
    if not completion.strip():
        raise DataError(f"{source}: empty {key!r}: nothing to prefer")
    prompt_ids = token_ids(tokenizer(prompt, add_special_tokens=True))
    target = token_ids(tokenizer(completion, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return prompt_ids + target, [IGNORE] * len(prompt_ids) + target


def tokenize_conversation(prompt: list, completion: list, tokenizer, key: str, source: str):
    """prompt rendered with the generation prompt, then prompt + completion; the completion's labels are the
    tokens after the prompt's render (which must be a prefix of the whole's)."""
    _check_messages(prompt, "prompt", source)
    _check_messages(completion, key, source)
    if prompt[-1]["role"] not in ("user", "tool", "system"):
        raise DataError(
            f"{source}: the prompt must end with a user turn for {key!r} to answer, not {prompt[-1]['role']!r}"
        )
    if completion[0]["role"] not in ANSWER_ROLES:
        raise DataError(f"{source}: {key!r} must answer the prompt: it starts with {completion[0]['role']!r}")
    check_turn_order([m["role"] for m in prompt + completion], source)
    head = token_ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    full = token_ids(tokenizer.apply_chat_template(prompt + completion, tokenize=True))
    start = len(head)
    if full[:start] != head:
        raise DataError(f"{source}: the chat template does not render the prompt as a prefix of the conversation")
    return full, [IGNORE] * start + full[start:]


def _check_messages(messages: list, key: str, source: str) -> None:
    if not messages:
        raise DataError(f"{source}: {key!r} is an empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{source}: {key}[{i}] must be a {{role, content}} message with string content, got {m!r}")


def fitted(ids: list[int], labels: list[int], cfg: DataSection, source: str) -> tuple[list, list] | str:
    """(ids, labels) within max_seq_len as data.overlength says (truncate cuts the completion's end), or why the
    pair is dropped: "overlength", or "no_target" (no completion token left)."""
    if len(ids) > cfg.max_seq_len:
        if cfg.overlength == "error":
            raise DataError(f"{source}: {len(ids)} tokens, over data.max_seq_len {cfg.max_seq_len} (overlength: error)")
        if cfg.overlength == "drop":
            return "overlength"
        ids, labels = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
    if not any(t != IGNORE for t in labels[1:]):
        return "no_target"
    return ids, labels


def tokenize_pair(row: dict, tokenizer, cfg: DataSection, source: str, stats: DataStats, index: int):
    """One row to a PreferencePair, or None (counted in stats) when either side is dropped."""
    prompt, chosen, rejected = split_row(row, source)
    fmt = "conversational" if isinstance(prompt, list) else "strings"
    stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
    tokenize = tokenize_conversation if fmt == "conversational" else tokenize_strings
    sides, truncated = [], 0
    for key, completion in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = tokenize(prompt, completion, tokenizer, key, source)
        truncated += len(ids) > cfg.max_seq_len
        kept = fitted(ids, labels, cfg, source)
        if isinstance(kept, str):
            setattr(stats, f"dropped_{kept}", getattr(stats, f"dropped_{kept}") + 1)
            return None
        sides.append(Example(*kept, source))
    if sides[0].input_ids == sides[1].input_ids:  # cut to the same tokens: a pair that prefers nothing
        stats.dropped_no_target += 1
        return None
    stats.truncated += truncated > 0
    stats.target_tokens += sum(sum(t != IGNORE for t in e.labels[1:]) for e in sides)
    return PreferencePair(sides[0], sides[1], source, index)


def build_pairs(
    cfg: DataSection, tokenizer, files: list | None = None, *, start: int = 0
) -> tuple[list[PreferencePair], DataStats]:
    """Every row of `files` (default data.train_files) as a pair, in file order, indexed from `start`; the
    dropped share checked."""
    files = cfg.train_files if files is None else files
    stats, pairs = DataStats(), []
    for source, row in load_rows(files):
        stats.rows += 1
        pair = tokenize_pair(row, tokenizer, cfg, source, stats, start + len(pairs))
        if pair is not None:
            pairs.append(pair)
    dropped = stats.rows - len(pairs)
    if pairs and dropped > cfg.max_dropped_share * stats.rows:
        raise DataError(
            f"{dropped} of {stats.rows} preference rows dropped ({stats.dropped_overlength} over max_seq_len, "
            f"{stats.dropped_no_target} with no completion token left), over data.max_dropped_share "
            f"{cfg.max_dropped_share}"
        )
    if not pairs:
        raise DataError(f"no trainable preference rows in {', '.join(map(entry_path, files))} ({stats.rows} read)")
    return pairs, stats
