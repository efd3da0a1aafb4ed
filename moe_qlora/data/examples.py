"""SFT data: rows (sources.py: files, folders, hub datasets) to masked token sequences and batches.

Row formats: {"prompt", "completion"} (or "response"), {"messages": [...]} through the tokenizer's chat
template, and {"text"}. Labels are -100 where no loss is taken (the prompt, unless train_on_prompt).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moe_qlora.config.sections import DataSection, RewardSection
from moe_qlora.data.sources import DataError, entry_path, load_rows

log = logging.getLogger(__name__)
IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One tokenized row. input_ids, labels: (L,). `source` is 'file:row' for messages about it."""

    input_ids: list[int]
    labels: list[int]
    source: str
    weight: float = 1.0  # rwsft: the sample's loss weight, carried with it through shuffling and batching
    # Packed rows (data.packing): positions restarting at 0 per row, and each token's row weight.
    position_ids: list[int] | None = None
    token_weights: list[float] | None = None


@dataclass
class DataStats:
    rows: int = 0
    truncated: int = 0
    dropped_overlength: int = 0
    dropped_no_target: int = 0
    cut_to_no_target: int = 0  # of dropped_no_target: rows that had targets, all past max_seq_len
    longest_cut_prompt: int = 0  # the most tokens before the first target among those rows
    target_tokens: int = 0
    formats: dict[str, int] = field(default_factory=dict)


def detect_format(row: dict, requested: str, source: str) -> str:
    """The row's format: the requested one, or from its keys when 'auto'."""
    present = {k for k, v in row.items() if v is not None}
    if requested != "auto":
        return requested
    if "messages" in present:
        return "messages"
    if "prompt" in present and ({"completion", "response"} & present):
        return "prompt_completion"
    if "text" in present:
        return "text"
    raise DataError(
        f"{source}: cannot tell the row format from keys {sorted(present)}; expected prompt+completion "
        "(or prompt+response), messages, or text"
    )


def _text_field(row: dict, key: str, source: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise DataError(f"{source}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def token_ids(enc) -> list[int]:
    """Token ids from a tokenizer call or apply_chat_template (list or BatchEncoding)."""
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def tokenize_prompt_completion(row, tokenizer, train_on_prompt, source):
    completion_key = "completion" if row.get("completion") is not None else "response"
    prompt, completion = _text_field(row, "prompt", source), _text_field(row, completion_key, source)
    if not completion.strip():
        raise DataError(f"{source}: empty {completion_key!r}: nothing to train on")
    prompt_ids = token_ids(tokenizer(prompt, add_special_tokens=True))
    target_ids = token_ids(tokenizer(completion, add_special_tokens=False)) + [tokenizer.eos_token_id]
    prompt_labels = prompt_ids if train_on_prompt else [IGNORE] * len(prompt_ids)
    return prompt_ids + target_ids, prompt_labels + target_ids


def _check_messages(messages, source):
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{source}: 'messages' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{source}: messages[{i}] must have role in {ROLES} and string content, got {m!r}")
    check_turn_order([m["role"] for m in messages], source)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise DataError(f"{source}: no assistant turn to train on")
    if not messages[assistant[-1]]["content"].strip():
        raise DataError(f"{source}: the last assistant turn is empty")
    return assistant


def check_turn_order(roles: list[str], source: str) -> None:
    """A system turn only first; then user and assistant alternate (tool turns answer an assistant)."""
    for i, role in enumerate(roles):
        prev = roles[i - 1] if i else None
        if role == "system" and i:
            problem = "a system turn after the first message"
        elif role == "user" and prev == "user":
            problem = "two user turns in a row"
        elif role == "assistant" and prev in (None, "system", "assistant"):
            problem = "an assistant turn with no user turn before it"
        elif role == "tool" and prev not in ("assistant", "tool"):
            problem = "a tool turn that answers no assistant turn"
        else:
            continue
        raise DataError(f"{source}: roles out of order at messages[{i}] ({role}): {problem}")


def tokenize_messages(row, tokenizer, train_on_prompt, all_turns, source):
    """Targets are assistant turns: the tokens between the generation prompt and the end of the turn.

    Spans come from rendering conversation prefixes, which needs a template whose render of a prefix is
    a prefix of the full render (true of common chat templates); a template that is not is refused.
    """
    messages = row["messages"]
    assistant = _check_messages(messages, source)
    full = token_ids(tokenizer.apply_chat_template(messages, tokenize=True))
    labels = list(full) if train_on_prompt else [IGNORE] * len(full)
    for i in assistant if all_turns else assistant[-1:]:
        start = len(token_ids(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)))
        end_ids = token_ids(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True))
        if full[: len(end_ids)] != end_ids or end_ids[:start] != full[:start]:
            raise DataError(f"{source}: the chat template does not render conversation prefixes as prefixes")
        labels[start : len(end_ids)] = full[start : len(end_ids)]
    return full, labels


def tokenize_text(row, tokenizer, source):
    text = _text_field(row, "text", source)
    if not text.strip():
        raise DataError(f"{source}: empty 'text'")
    ids = token_ids(tokenizer(text, add_special_tokens=True)) + [tokenizer.eos_token_id]
    return ids, list(ids)


def tokenize_row(row: dict, tokenizer, cfg: DataSection, source: str, stats: DataStats) -> Example | None:
    """One row to an Example, applying max_seq_len; None (counted in stats) when the row is dropped."""
    fmt = detect_format(row, cfg.format, source)
    stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
    if fmt == "prompt_completion":
        ids, labels = tokenize_prompt_completion(row, tokenizer, cfg.train_on_prompt, source)
    elif fmt == "messages":
        if "messages" not in row:
            raise DataError(f"{source}: format 'messages' needs a 'messages' field")
        ids, labels = tokenize_messages(row, tokenizer, cfg.train_on_prompt, cfg.all_assistant_turns, source)
    else:
        ids, labels = tokenize_text(row, tokenizer, source)
    if len(ids) > cfg.max_seq_len:
        if cfg.overlength == "error":
            raise DataError(f"{source}: {len(ids)} tokens, over data.max_seq_len {cfg.max_seq_len} (overlength: error)")
        if cfg.overlength == "drop":
            stats.dropped_overlength += 1
            return None
        stats.truncated += 1
        full_labels, ids, labels = labels, ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
        if not any(t != IGNORE for t in labels[1:]) and (first := first_target(full_labels)) is not None:
            stats.cut_to_no_target += 1
            stats.longest_cut_prompt = max(stats.longest_cut_prompt, first)
    # The label of position t is predicted from position t-1: the first label is never used.
    n_targets = sum(1 for t in labels[1:] if t != IGNORE)
    if n_targets == 0:
        stats.dropped_no_target += 1  # never trained on as a zero loss
        return None
    stats.target_tokens += n_targets
    return Example(ids, labels, source)


REWARD_KEYS = ("reward", "score")  # `score`: llama.cpp's sample_rwsft_data.jsonl


def row_reward(row: dict, source: str) -> float:
    """The row's reward, which must be a finite number under `reward` or `score`."""
    # datasets gives None for a column other rows have: that is a missing reward too.
    key = next((k for k in REWARD_KEYS if row.get(k) is not None), None)
    if key is None:
        raise DataError(f"{source}: rwsft needs a numeric 'reward' (or 'score') field; the row has {sorted(row)}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{source}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def first_target(labels: list[int]) -> int | None:
    """The position of the first label trained on (the first label is never used), None when there is none."""
    return next((i for i, t in enumerate(labels) if i > 0 and t != IGNORE), None)


def dropped_counts(stats: DataStats, max_seq_len: int) -> str:
    """'N over max_seq_len, M with no target left', saying which of the M lost their targets to truncation and
    what length keeps them: the truncation, not the rows, is then what to change."""
    text = f"{stats.dropped_overlength} over max_seq_len, {stats.dropped_no_target} with no target left"
    if stats.cut_to_no_target:
        text += (
            f", {stats.cut_to_no_target} of them because truncating to data.max_seq_len {max_seq_len} cut away every "
            f"target token (the latest first target is token {stats.longest_cut_prompt + 1}: data.max_seq_len "
            f"{stats.longest_cut_prompt + 1} or more keeps at least one of each)"
        )
    return text


def build_examples(cfg: DataSection, tokenizer, *, rewards: bool = False) -> tuple[list[Example], DataStats]:
    """Tokenize every row; with `rewards`, each example's weight is its row's raw reward (mapped later)."""
    stats = DataStats()
    examples = []
    for source, row in load_rows(cfg.train_files):
        stats.rows += 1
        reward = row_reward(row, source) if rewards else 1.0
        ex = tokenize_row(row, tokenizer, cfg, source, stats)
        if ex is not None:
            examples.append(dataclasses.replace(ex, weight=reward))
    dropped = stats.dropped_overlength + stats.dropped_no_target
    if examples and dropped > cfg.max_dropped_share * stats.rows:
        raise DataError(
            f"{dropped} of {stats.rows} rows dropped ({dropped_counts(stats, cfg.max_seq_len)}), over "
            f"data.max_dropped_share {cfg.max_dropped_share}"
        )
    if not examples:
        raise DataError(
            f"no trainable rows in {', '.join(map(entry_path, cfg.train_files))} ({stats.rows} read, "
            f"{dropped_counts(stats, cfg.max_seq_len)})"
        )
    return examples, stats


def eval_split(examples: list[Example], fraction: float, *, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval): a seeded share of the examples held out, at least one, never in both; each keeps the
    file order."""
    if not fraction:
        return examples, []
    n_eval = max(1, round(fraction * len(examples)))
    if n_eval >= len(examples):
        raise DataError(f"data.eval_fraction {fraction} of {len(examples)} examples leaves none to train on")
    g = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    held = set(torch.randperm(len(examples), generator=g)[:n_eval].tolist())
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def epoch_order(num_examples: int, *, seed: int, epoch: int) -> list[int]:
    """The shuffled order of one epoch: a function of (seed, epoch) only, so a run is reproducible."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=g).tolist()


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, labels (-100 on padding), attention_mask (B, L); weights (B,). Packed
    examples add position_ids (padding continues as a row of its own) and token_weights (B, L)."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    weights = torch.tensor([e.weight for e in examples], dtype=torch.float32)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "weights": weights}
    if any(e.position_ids is not None for e in examples):
        batch["position_ids"] = torch.arange(length).repeat(len(examples), 1)
        batch["token_weights"] = torch.zeros((len(examples), length), dtype=torch.float32)
        for i, e in enumerate(examples):
            n = len(e.input_ids)
            batch["position_ids"][i, :n] = torch.tensor(e.position_ids)
            batch["token_weights"][i, :n] = torch.tensor(e.token_weights)
    return batch


def pack_examples(examples: list[Example], max_len: int) -> list[Example]:
    """Rows packed into sequences of at most `max_len` tokens by best-fit decreasing (longest rows first,
    each into the fullest sequence it fits; ties by file order, so packing is deterministic).

    Each row keeps its positions (restarting at 0, so transformers masks attention block-diagonally from
    position_ids), its label masking and its weight on every one of its tokens. The first token of each row
    gets no label: it would be predicted from the previous row's last token, which a row alone never does.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    bins: list[list[int]] = []
    by_room: list[tuple[int, int]] = []  # (room left, bin), sorted: the best fit is the first with room >= n
    for i in order:
        n = len(examples[i].input_ids)
        at = bisect.bisect_left(by_room, (n, -1))
        if at < len(by_room):
            room, b = by_room.pop(at)
            bins[b].append(i)
        else:
            room, b = max_len, len(bins)
            bins.append([i])
        bisect.insort(by_room, (room - n, b))
    return [_packed(sorted(members), examples) for members in sorted(bins, key=min)]


def _packed(members: list[int], examples: list[Example]) -> Example:
    ids, labels, positions, weights = [], [], [], []
    for i in members:
        e = examples[i]
        ids += e.input_ids
        labels += [IGNORE] + e.labels[1:]
        positions += list(range(len(e.input_ids)))
        weights += [e.weight] * len(e.input_ids)
    source = "+".join(examples[i].source for i in members)
    return Example(ids, labels, source, 1.0, position_ids=positions, token_weights=weights)


def micro_batches(examples: list[Example], order: list[int], size: int) -> Iterator[list[Example]]:
    """Consecutive groups of `size` examples in `order` (the last may be smaller)."""
    for i in range(0, len(order), size):
        yield [examples[j] for j in order[i : i + size]]


def _clip(w: float, lo: float | None, hi: float | None) -> float:
    if lo is not None:
        w = max(w, lo)
    return w if hi is None else min(w, hi)


def reward_weights(rewards: list[float], cfg: RewardSection) -> list[float]:
    """Rewards to loss weights as configured: mapping over the whole dataset, then clipping, then the sign check."""
    if cfg.mapping == "minmax":
        lo, hi = min(rewards), max(rewards)
        weights = [1.0 if hi == lo else (r - lo) / (hi - lo) for r in rewards]
    elif cfg.mapping == "zscore":
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        weights = [0.0 if std == 0 else (r - mean) / std for r in rewards]
    else:
        weights = list(rewards)
    weights = [_clip(w, cfg.clip_min, cfg.clip_max) for w in weights]
    negative = sum(w < 0 for w in weights)
    if negative and not cfg.allow_negative:
        raise DataError(
            f"{negative} samples get a negative weight (mapping {cfg.mapping}); negative weights push probability "
            "away from a sample (unlikelihood): set reward.allow_negative: true, or reward.clip_min: 0"
        )
    if negative:
        log.warning("%d samples have negative weights: their probability is pushed down (unlikelihood)", negative)
    return weights


def apply_reward_weights(examples: list[Example], cfg: RewardSection) -> list[Example]:
    """Replace each example's raw reward by its weight; the pairing with its sample never changes."""
    weights = reward_weights([e.weight for e in examples], cfg)
    return [dataclasses.replace(e, weight=w) for e, w in zip(examples, weights, strict=True)]
