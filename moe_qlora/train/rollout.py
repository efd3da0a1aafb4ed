"""GRPO rollouts: prompt rows, sampling G completions per prompt with the KV cache, and offline rollouts;
RolloutSource gives a step its scored rollouts from either.

A rollout is one (prompt, completion) pair with its token ids; the completion ends at the first EOS
(included: the policy learns to stop) or right after the first stop string (nothing after it is trained).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from rich.console import Console
from transformers import GenerationConfig

from moe_qlora.config.grpo import GrpoSection
from moe_qlora.config.sections import DataSection, RunConfig
from moe_qlora.data.examples import _check_messages, token_ids
from moe_qlora.data.sources import DataError, entry_path, load_rows
from moe_qlora.model.distributed import SINGLE, Ranks, rank_slice
from moe_qlora.moe.experts import generation_kernels
from moe_qlora.train.checkpoint import fingerprint
from moe_qlora.train.faults import local_stretch, run_as_is
from moe_qlora.train.position import StepPosition
from moe_qlora.train.rewards import RewardPolicy, resolve_reward, score

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
        return token_ids(tokenizer(row["prompt"], add_special_tokens=True)), row["prompt"]
    messages = row.get("messages")
    if messages is None:
        raise DataError(f"{source}: a GRPO prompt row needs 'prompt' (a string) or 'messages'; it has {sorted(row)}")
    if (
        isinstance(messages, list)
        and messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
    ):
        messages = messages[:-1]  # a reference answer in the row is not part of the prompt
    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
        raise DataError(f"{source}: 'messages' of a GRPO prompt must end with a user turn")
    _check_messages([*messages, {"role": "assistant", "content": "x"}], source)
    ids = token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return ids, messages[-1]["content"]


def load_prompts(cfg: DataSection, tokenizer, max_new_tokens: int) -> tuple[list[PromptRow], int]:
    """Every prompt row; (prompts, how many were dropped as over-long). Room is left for the completion:
    a prompt may take max_seq_len - max_new_tokens tokens; longer ones follow `data.overlength`
    (truncate keeps the prompt's end, which holds the question)."""
    room = cfg.max_seq_len - max_new_tokens
    if room < 1:
        raise DataError(
            f"data.max_seq_len ({cfg.max_seq_len}) leaves no room for a prompt beside "
            f"grpo.max_new_tokens ({max_new_tokens})"
        )
    prompts, dropped = [], 0
    for source, row in load_rows(cfg.train_files):
        ids, text = _prompt_ids(row, tokenizer, source)
        if len(ids) > room:
            if cfg.overlength == "error":
                raise DataError(
                    f"{source}: prompt of {len(ids)} tokens, over data.max_seq_len - grpo.max_new_tokens "
                    f"= {room} (overlength: error)"
                )
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
        do_sample=True,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        num_return_sequences=cfg.group_size,
        use_cache=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        stop_strings=cfg.stop or None,
    )


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


def sample_rollouts(
    model, tokenizer, prompts: list[PromptRow], cfg: GrpoSection, *, synced: bool = False
) -> list[Rollout]:
    """G completions of each prompt from the current policy (adapters on, eval mode, KV cache). `synced`: a
    sharded run's ranks, each generating until every one is done (transformers' synced_gpus), so every forward
    is joined by all of them. Under no_grad there (FSDP gathers parameters that the update then trains, which
    must not be inference tensors), inference_mode otherwise.

    Returns P*G rollouts, prompt-major (the G of prompt 0 first), the order advantages assume.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad([p.ids for p in prompts], tokenizer.pad_token_id)
    was_training = model.training
    model.eval()  # no dropout while sampling; checkpointed layers keep the KV cache only in eval mode
    try:
        with torch.no_grad() if synced else torch.inference_mode(), generation_kernels(model):
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=generation_config(cfg, tokenizer),
                tokenizer=tokenizer,
                synced_gpus=synced,
            )
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
        if (
            not isinstance(completions, list)
            or len(completions) < 2
            or not all(isinstance(c, str) and c for c in completions)
        ):
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
            ids = token_ids(tokenizer(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
            ids = ids[: max(1, max_seq_len - len(group.prompt.ids))]
            rollouts.append(Rollout(group.prompt, g, ids, text))
    return rollouts


def columns_of(rollouts: list[Rollout]) -> dict[str, list]:
    """The prompt rows' other fields, one entry per completion (what reward functions get as **columns)."""
    keys = sorted({k for r in rollouts for k in r.prompt.columns})
    return {k: [r.prompt.columns.get(k) for r in rollouts] for k in keys}


class RolloutSource:
    """Where a step's scored rollouts come from: sampling + reward functions (online), or a file (offline)."""

    def __init__(self, cfg: RunConfig, tokenizer, console: Console):
        g = cfg.grpo
        self.cfg, self.tokenizer, self.offline = cfg, tokenizer, g.offline_file is not None
        self.sampling_s = 0.0  # the last collect's time in generate (a rank's own share of the prompts)
        self.reward_errors = 0  # samples of the last collect() scored 0 after a reward function failed
        if self.offline:
            self.items = load_offline_groups(g.offline_file, cfg.data, tokenizer)
            self.identity = fingerprint([x.prompt.source, x.prompt.ids, x.completions, x.rewards] for x in self.items)
            console.print(
                f"grpo offline: {len(self.items)} prompts with "
                f"{sum(len(x.completions) for x in self.items)} scored completions"
            )
        else:
            self.items, dropped = load_prompts(cfg.data, tokenizer, g.max_new_tokens)
            self.identity = fingerprint([p.source, p.ids, p.columns] for p in self.items)
            self.functions = [resolve_reward(spec, i) for i, spec in enumerate(g.rewards)]
            console.print(
                f"grpo: {len(self.items)} prompts ({dropped} dropped as over-long), {g.group_size} "
                f"completions each; rewards {', '.join(f'{s.weight:g} x {s.function}' for s in g.rewards)}"
            )

    def collect(
        self, model, batch: list, position: StepPosition, first: int = 0, ranks: Ranks = SINGLE
    ) -> tuple[list[Rollout], list[float], dict[str, list[float]], list[int]]:
        """(rollouts, total rewards, rewards per function, group sizes) of one step's prompts, sampling and scoring
        marked as phases of `position`; a failing reward names its prompt as `first` + its place in `batch` (a
        rank's share starts at `first`) and its step."""
        if self.offline:
            rollouts = offline_rollouts(batch, self.tokenizer, self.cfg.data.max_seq_len)
            return rollouts, [r for grp in batch for r in grp.rewards], {}, [len(grp.completions) for grp in batch]
        with position.within("generation"):
            started = time.perf_counter()
            rollouts = sample_rollouts(model, self.tokenizer, batch, self.cfg.grpo, synced=ranks.sharded)
            self.sampling_s = time.perf_counter() - started
        prompts, completions = [r.prompt.text for r in rollouts], [r.text for r in rollouts]
        g = self.cfg.grpo
        policy = RewardPolicy(on_error=g.reward_errors, timeout_s=g.reward_timeout_s, step=position.step)
        # Under fsdp / ep the step runs outside local_stretch (its forwards hold collectives): the rewards, which
        # hold none, get their own, so a failing reward still meets the other ranks.
        stretch = local_stretch if ranks.sharded else run_as_is  # ddp: the step's own stretch meets them
        with position.within("rewards"):
            rewards, per_fn, self.reward_errors = stretch(
                ranks,
                score,
                self.functions,
                prompts,
                completions,
                columns_of(rollouts),
                policy=policy,
                groups=[first + r.group for r in rollouts],
                sources=[r.prompt.source for r in rollouts],
            )
        return rollouts, rewards, per_fn, [g.group_size] * len(batch)

    def collect_share(self, model, batch: list, ranks: Ranks, position: StepPosition):
        """collect() on this rank's whole prompts of the batch (a group is never split across ranks), numbered
        as in the whole batch. Data parallel sampling draws from a generator seeded by (seed, step, rank): the
        ranks sample independently, and a resumed run samples what the uninterrupted one did."""
        first, mine = rank_slice(batch, ranks)
        if not ranks.enabled:
            return self.collect(model, mine, position)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(hash((self.cfg.train.seed, position.step, ranks.rank)) % 2**63)
            if mine:
                rollouts, rewards, per_fn, sizes = self.collect(model, mine, position, first, ranks)
            else:
                rollouts, rewards, per_fn, sizes = [], [], {}, []
                if ranks.sharded and not self.offline:  # no prompt here: sample one, dropped, to join the forwards
                    sample_rollouts(model, self.tokenizer, batch[:1], self.cfg.grpo, synced=True)
                    local_stretch(ranks, list)  # and the rewards' meeting point
        return [replace(r, group=r.group + first) for r in rollouts], rewards, per_fn, sizes
