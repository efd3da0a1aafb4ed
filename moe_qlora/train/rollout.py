"""GRPO rollouts: prompt rows, sampling G completions per prompt with the KV cache, and offline rollouts.

A rollout is one (prompt, completion) pair with its token ids; the completion ends at the first EOS
(included: the policy learns to stop) or right after the first stop string (nothing after it is trained).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from moe_qlora.config.schema import DataSection, GrpoSection
from moe_qlora.data.examples import _check_messages, _ids
from moe_qlora.data.sources import DataError, entry_path, load_rows

PROMPT_KEYS = ("prompt", "messages")


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its token ids, its text for reward functions, and the row's other fields (e.g. answer)."""

    source: str
    ids: list[int]
    text: str
    columns: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rollout:
    """A completion of a prompt. group: index of its prompt in the batch. reward filled in by scoring."""

    prompt: PromptRow
    group: int
    completion_ids: list[int]
    text: str
    truncated: bool = False  # cut by max_new_tokens: no EOS, no stop string


def _prompt_ids(row: dict, tokenizer, source: str) -> tuple[list[int], str]:
    """Token ids and text of a row's prompt: a string as is, or `messages` ending in a user turn through
    the chat template with the generation prompt (an assistant turn would be what we sample)."""
    if isinstance(row.get("prompt"), str):
        if not row["prompt"].strip():
            raise DataError(f"{source}: empty 'prompt'")
        return _ids(tokenizer(row["prompt"], add_special_tokens=True)), row["prompt"]
    messages = row.get("messages")
    if messages is None:
        raise DataError(f"{source}: a GRPO prompt row needs 'prompt' (a string) or 'messages'; it has {sorted(row)}")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and \
            messages[-1].get("role") == "assistant":  # fmt: skip
        messages = messages[:-1]  # a reference answer in the row is not part of the prompt
    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
        raise DataError(f"{source}: 'messages' of a GRPO prompt must end with a user turn")
    _check_messages([*messages, {"role": "assistant", "content": "x"}], source)
    ids = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return ids, messages[-1]["content"]


def load_prompts(cfg: DataSection, tokenizer, max_new_tokens: int) -> tuple[list[PromptRow], int]:
    """Every prompt row; (prompts, how many were dropped as over-long). Room is left for the completion:
    a prompt may take max_seq_len - max_new_tokens tokens; longer ones follow `data.overlength`
    (truncate keeps the prompt's end, which holds the question)."""
    room = cfg.max_seq_len - max_new_tokens
    if room < 1:
        raise DataError(f"data.max_seq_len ({cfg.max_seq_len}) leaves no room for a prompt beside "
                        f"grpo.max_new_tokens ({max_new_tokens})")  # fmt: skip
    prompts, dropped = [], 0
    for source, row in load_rows(cfg.train_files):
        ids, text = _prompt_ids(row, tokenizer, source)
        if len(ids) > room:
            if cfg.overlength == "error":
                raise DataError(f"{source}: prompt of {len(ids)} tokens, over data.max_seq_len - grpo.max_new_tokens "
                                f"= {room} (overlength: error)")  # fmt: skip
            if cfg.overlength == "drop":
                dropped += 1
                continue
            ids = ids[-room:]
        columns = {k: v for k, v in row.items() if k not in PROMPT_KEYS}
        prompts.append(PromptRow(source, ids, text, columns))
    if not prompts:
        raise DataError(f"no usable prompts in {', '.join(map(entry_path, cfg.train_files))}")
    return prompts, dropped


def generation_config(cfg: GrpoSection, tokenizer) -> GenerationConfig:
    """Sampling settings, all explicit (a checkpoint's own generation_config must not add top-k etc.)."""
    return GenerationConfig(
        do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens, num_return_sequences=cfg.group_size, use_cache=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, stop_strings=cfg.stop or None,
    )  # fmt: skip


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), (B, L), padded on the left so every prompt ends at the last column."""
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, length - len(s) :] = torch.tensor(s)
        mask[i, length - len(s) :] = 1
    return ids, mask


def completion_end(ids: list[int], tokenizer, eos_id: int, stop: list[str]) -> int:
    """Length of the completion within the generated `ids`: through the first EOS, or through the token
    that completes the first stop string, else all of it (the rest is padding of a finished sequence)."""
    end = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
    if stop and any(s in tokenizer.decode(ids[:end]) for s in stop):
        lo, hi = 1, end  # the shortest prefix holding a stop string: containing one is monotone in length
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in tokenizer.decode(ids[:mid]) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        end = lo
    return end


def is_truncated(completion: list[int], tokenizer, *, max_new_tokens: int, stop: list[str]) -> bool:
    """True when generation stopped at max_new_tokens, not at EOS or a stop string."""
    if len(completion) < max_new_tokens or tokenizer.eos_token_id in completion:
        return False
    return not (stop and any(s in tokenizer.decode(completion) for s in stop))


@torch.inference_mode()
def sample_rollouts(model, tokenizer, prompts: list[PromptRow], cfg: GrpoSection) -> list[Rollout]:
    """G completions of each prompt from the current policy (adapters on, eval mode, KV cache).

    Returns P*G rollouts, prompt-major (the G of prompt 0 first), the order advantages assume.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad([p.ids for p in prompts], tokenizer.pad_token_id)
    was_training = model.training
    model.eval()  # no dropout while sampling; checkpointed layers keep the KV cache only in eval mode
    try:
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=generation_config(cfg, tokenizer), tokenizer=tokenizer)  # fmt: skip
    finally:
        model.train(was_training)
    generated = out[:, ids.shape[1] :].tolist()
    rollouts = []
    for i, gen in enumerate(generated):
        end = completion_end(gen, tokenizer, tokenizer.eos_token_id, cfg.stop)
        completion = gen[:end]
        text = tokenizer.decode(completion, skip_special_tokens=True)
        truncated = is_truncated(completion, tokenizer, max_new_tokens=cfg.max_new_tokens, stop=cfg.stop)
        rollouts.append(Rollout(prompts[i // cfg.group_size], i // cfg.group_size, completion, text, truncated))
    return rollouts


@dataclass(frozen=True)
class OfflineGroup:
    """A prompt with completions generated elsewhere and their rewards."""

    prompt: PromptRow
    completions: list[str]
    rewards: list[float]


def load_offline_groups(path: str, data_cfg: DataSection, tokenizer) -> list[OfflineGroup]:
    """Rows {prompt | messages, completions: [str], rewards (or scores): [float]}: one group a row."""
    cfg = data_cfg.model_copy(update={"train_files": [path]})
    groups = []
    for source, row in load_rows(cfg.train_files):
        ids, text = _prompt_ids(row, tokenizer, source)
        completions = row.get("completions")
        rewards = row.get("rewards", row.get("scores"))
        if not isinstance(completions, list) or len(completions) < 2 or \
                not all(isinstance(c, str) and c for c in completions):  # fmt: skip
            raise DataError(f"{source}: 'completions' must be a list of at least 2 non-empty strings")
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise DataError(f"{source}: 'rewards' (or 'scores') must be a list with one number per completion")
        for r in rewards:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or r != r or r in (float("inf"), -float("inf")):
                raise DataError(f"{source}: rewards must be finite numbers, got {r!r}")
        columns = {k: v for k, v in row.items() if k not in (*PROMPT_KEYS, "completions", "rewards", "scores")}
        groups.append(OfflineGroup(PromptRow(source, ids, text, columns), completions, [float(r) for r in rewards]))
    if not groups:
        raise DataError(f"{path}: no offline groups")
    return groups


def offline_rollouts(groups: list[OfflineGroup], tokenizer, max_seq_len: int) -> list[Rollout]:
    """Tokenized rollouts of offline groups; a completion gets EOS appended (it ended), and the prompt +
    completion is cut to max_seq_len from the completion's end."""
    rollouts = []
    for g, group in enumerate(groups):
        for text in group.completions:
            ids = _ids(tokenizer(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
            ids = ids[: max(1, max_seq_len - len(group.prompt.ids))]
            rollouts.append(Rollout(group.prompt, g, ids, text))
    return rollouts
