"""Trainer-side batching: experiences -> per-rank lists -> padded micro-batches (DESIGN section 2.6)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, fields

import torch

from molt.objectives import (compute_dr_grpo_advantages, compute_group_mean_advantages, compute_grpo_advantages,
                             compute_rloo_advantages)
from molt.trace.experience import Experience
from molt.trace.routes import ROUTE_DTYPE, UNKNOWN

GROUP_ADVANTAGES = {"grpo": compute_grpo_advantages, "dr_grpo": compute_dr_grpo_advantages,
                    "group_mean": compute_group_mean_advantages, "rloo": compute_rloo_advantages}


@dataclass(kw_only=True)
class MicroBatch:
    """The experiences of one forward/backward. Always at least one row, maybe no action tokens.

    The objectives see right-padded rows, one experience each. The model sees either those rows
    (with an attention mask) or, packed, rows holding several experiences back to back, each with
    its own position ids, so attention stays within each (`model_inputs`); `to_rows` brings what
    the model computed per token back to the padded rows. See `LAYOUTS`.
    """

    input_ids: torch.Tensor  # [batch, seq] long
    attention_mask: torch.Tensor  # [batch, seq] long, 1 = real token
    action_mask: torch.Tensor  # [batch, seq] float, 1 = policy action
    behavior_logprobs: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    advantages: torch.Tensor  # [batch, seq] float, 0 off the action tokens
    # The temperature each token was sampled at: its experience's own where it has them, the run's
    # (rollout.temperature) elsewhere and on padding. Log-probs are recomputed at them (score_micro_batch).
    temperatures: torch.Tensor  # [batch, seq] float32
    rewards: torch.Tensor  # [batch] float64, each row's rollout reward (0 for a filler row)
    truncated: torch.Tensor  # [batch] bool, each row's Experience.truncated (False for a filler row)
    rows: list[int]  # [batch] index of each row's experience in the rank's list; -1 = filler
    # Routed experts for routing replay (molt.trace.routes): each experience's own, -1 (unknown) on padding
    # and for an experience without routes; None when no experience here has any.
    routed_experts: torch.Tensor | None = None  # [batch, seq, layers, top_k] int16
    # The experiences' image tensors (molt.trace.images.ImageInputs.tensors), concatenated along dim 0 in
    # row order, each experience's images in its own order: the order the model reads their
    # placeholder tokens, padded or packed (packed rows keep the rows' order). None without images.
    image_inputs: dict[str, torch.Tensor] | None = None  # name -> [tiles over all images, ...]
    # Packed micro-batches only (None when padded):
    packed_ids: torch.Tensor | None = None  # [packed_rows, width] the packed token ids (pad at row ends)
    position_ids: torch.Tensor | None = None  # [packed_rows, width] each token's position in its own sequence
    packed_index: torch.Tensor | None = None  # [packed_rows * width] index into input_ids.view(-1); -1 = pad
    # Filled per step by the learner when the objective needs them ([batch, seq], 0 off actions):
    ref_logprobs: torch.Tensor | None = None  # the frozen reference policy's log-probs
    old_values: torch.Tensor | None = None  # the critic's values before this step's update
    returns: torch.Tensor | None = None  # the critic's regression targets
    proximal_logprobs: torch.Tensor | None = None  # the actor's log-probs before the step's first update

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    @property
    def num_model_tokens(self) -> int:
        """Positions the model computes (packed rows x width, or padded rows x longest row)."""
        return self.packed_ids.numel() if self.packed_ids is not None else self.input_ids.numel()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward: padded rows with their attention mask, or packed
        rows with per-sequence position ids and no mask (Hugging Face then keeps attention within
        each sequence: a block-diagonal causal mask per row, or variable-length flash attention on
        CUDA where flash-attn is installed: molt.trainer.sharded_model.choose_attention)."""
        inputs = ({"input_ids": self.input_ids, "attention_mask": self.attention_mask} if self.packed_ids is None
                  else {"input_ids": self.packed_ids, "position_ids": self.position_ids})
        if self.image_inputs is not None:
            inputs["image_inputs"] = self.image_inputs  # molt.trainer.scoring.score_tokens formats them for the model
        return inputs

    def model_temperatures(self) -> torch.Tensor:
        """`temperatures` laid out like `model_inputs()`: the padded rows, or [packed_rows, width]
        with 1 on a packed row's pad tail (whose log-probs `to_rows` drops)."""
        return self.model_layout(self.temperatures, fill=1.0)

    def model_layout(self, values: torch.Tensor, *, fill: float | bool) -> torch.Tensor:
        """Per-token `values` ([batch, seq, ...], like `input_ids`) laid out like `model_inputs()`:
        as they are when padded; packed, [packed_rows, width, ...] with `fill` on the pad tail."""
        if self.packed_ids is None:
            return values
        per_token = values.shape[2:]
        real = self.packed_index >= 0
        flat = values.new_full((len(self.packed_index), *per_token), fill)
        flat[real] = values.reshape(-1, *per_token)[self.packed_index[real]]
        return flat.view(*self.packed_ids.shape, *per_token)

    def model_routed_experts(self) -> torch.Tensor | None:
        """`routed_experts` laid out like `model_inputs()`: the padded rows, or [packed_rows, width,
        layers, top_k] with -1 (unknown) on a packed row's pad tail; None without routes."""
        return None if self.routed_experts is None else self.model_layout(self.routed_experts, fill=UNKNOWN)

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """[batch, seq] from per-token `values` laid out like `model_inputs()` (0 on padding)."""
        if self.packed_ids is None:
            return values
        real = self.packed_index >= 0
        flat = values.new_zeros(self.input_ids.numel()).index_copy(0, self.packed_index[real], values.reshape(-1)[real])
        return flat.view(self.input_ids.shape)

    def to(self, device: torch.device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.image_inputs is not None:
            moved["image_inputs"] = {name: tensor.to(device) for name, tensor in self.image_inputs.items()}
        return MicroBatch(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                             for name, value in moved.items()})


def compute_group_advantages(rollout_ids: list[int], group_ids: list[int], rewards: list[float], *,
                             estimator: str) -> list[float]:
    """One advantage per entry (an experience) from a group estimator (molt.objectives). Entries of
    one rollout (its segments) count once in the group statistics and all get its advantage."""
    if estimator not in GROUP_ADVANTAGES:
        raise ValueError(f"{estimator!r} is not a group estimator; use one of {', '.join(GROUP_ADVANTAGES)}")
    rollouts = {}
    for rollout_id, group_id, reward in zip(rollout_ids, group_ids, rewards, strict=True):
        rollouts.setdefault(rollout_id, (reward, group_id))
    if not rollouts:
        return []
    per_rollout = GROUP_ADVANTAGES[estimator](
        torch.tensor([reward for reward, _ in rollouts.values()], dtype=torch.float64),
        torch.tensor([group for _, group in rollouts.values()]))
    advantage_of = dict(zip(rollouts, per_rollout.tolist()))
    return [advantage_of[rollout_id] for rollout_id in rollout_ids]


def assign_to_ranks(experiences: list[Experience], num_ranks: int) -> list[list[int]]:
    """Split experience indices over ranks, longest first onto the least-loaded rank.

    Greedy longest-processing-time scheduling on token count: the heaviest rank carries at most
    the lightest rank's load plus one experience's tokens. Indices within a rank are ascending.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [(0, rank) for rank in range(num_ranks)]  # (tokens, rank) min-heap
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    by_length = sorted(range(len(experiences)), key=lambda i: (-experiences[i].num_tokens, i))
    for index in by_length:
        tokens, rank = heapq.heappop(loads)
        assignment[rank].append(index)
        heapq.heappush(loads, (tokens + experiences[index].num_tokens, rank))
    return [sorted(indices) for indices in assignment]


LAYOUTS = ("padded", "rows", "row")
"""How a micro-batch's experiences are laid out for the model (`molt.trainer.policy.packing_layout` picks one):
- padded: one experience per row, right-padded to the longest; budget rows x longest.
- rows: packed into rows as wide as the micro-batch's longest experience, first-fit decreasing, pad
  only at row ends; budget rows x width. Attention cost stays rows x width^2, as padded, which a
  block-diagonal mask (sdpa, eager: CPU) needs.
- row: one packed row of at most the budget (flash attention's variable-length kernels, whose cost
  is the sequences' own, not the row's)."""


def split_into_windows(experiences: list[Experience], num_windows: int) -> list[list[int]]:
    """Experience indices of each optimizer window (PPO mini-batch), balanced by tokens like ranks."""
    return assign_to_ranks(experiences, num_windows)


def count_window_micro_batches(experiences: list[Experience], *, num_windows: int, max_tokens_per_micro_batch: int,
                               layout: str) -> list[int]:
    """Micro-batches each window of `build_windows` needs for these experiences (0 for an empty one).

    The controller takes the max over ranks per window, so every rank runs as many forwards and
    backwards in each window and joins every FSDP collective."""
    return [count_micro_batches([experiences[i] for i in window], max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                layout=layout)
            for window in split_into_windows(experiences, num_windows)]


def share_step_batch(experiences: list[Experience], *, num_ranks: int, num_windows: int,
                     max_tokens_per_micro_batch: int, layout: str) -> tuple[list[list[int]], list[int]]:
    """Each data-parallel rank's experience indices (`assign_to_ranks`) and each optimizer window's
    micro-batch count, the same on every rank: the busiest rank's, at least 1. A rank with a light
    share, or none (fewer experiences than ranks, a step whose groups were all filtered), fills its
    windows with empty micro-batches, so it runs every forward, backward and collective of the step
    and no rank waits in one alone."""
    shares = assign_to_ranks(experiences, num_ranks)
    counts = [count_window_micro_batches([experiences[i] for i in share], num_windows=num_windows,
                                         max_tokens_per_micro_batch=max_tokens_per_micro_batch, layout=layout)
              for share in shares]
    return shares, [max(1, *column) for column in zip(*counts)]


def build_windows(experiences: list[Experience], *, num_windows: int, micro_batch_counts: list[int],
                  max_tokens_per_micro_batch: int, pad_token_id: int, layout: str,
                  temperature: float = 1.0) -> list[list[MicroBatch]]:
    """This rank's experiences as `num_windows` optimizer windows of micro-batches, each padded with
    empty micro-batches to `micro_batch_counts[window]`. Rows index the rank's whole list.
    `temperature`: the run's sampling temperature (see `build_micro_batches`)."""
    if len(micro_batch_counts) != num_windows:
        raise ValueError(f"need a micro-batch count per window: {num_windows} windows, {len(micro_batch_counts)} counts")
    windows = []
    for window, count in zip(split_into_windows(experiences, num_windows), micro_batch_counts):
        micro_batches = build_micro_batches([experiences[i] for i in window], max_tokens_per_micro_batch=
                                            max_tokens_per_micro_batch, pad_token_id=pad_token_id,
                                            num_micro_batches=count, layout=layout, temperature=temperature)
        for micro_batch in micro_batches:
            micro_batch.rows = [window[row] if row >= 0 else -1 for row in micro_batch.rows]
        windows.append(micro_batches)
    return windows


def count_micro_batches(experiences: list[Experience], *, max_tokens_per_micro_batch: int,
                        layout: str = "padded") -> int:
    """How many micro-batches `build_micro_batches` needs for these experiences (0 if none).

    Ranks all-reduce the max of this so each pads to the same count.
    """
    lengths = [experience.num_tokens for experience in experiences]
    return len(_group_by_budget(lengths, max_tokens_per_micro_batch, layout))


def build_micro_batches(
    experiences: list[Experience],
    advantages: list[float] | None = None,
    *,
    max_tokens_per_micro_batch: int,
    pad_token_id: int,
    num_micro_batches: int | None = None,
    layout: str = "padded",
    temperature: float = 1.0,
) -> list[MicroBatch]:
    """Group experiences into micro-batches of at most `max_tokens_per_micro_batch` computed
    positions in the given layout (`LAYOUTS`), longest first. A sequence longer than the budget gets
    a micro-batch of its own. With `num_micro_batches`, the list is padded with empty micro-batches
    (one real-token row with no actions) up to that count, so every rank runs the same number of
    forwards and backwards and joins every FSDP collective.

    Args:
        advantages: one per experience, broadcast onto its action tokens; None leaves them 0 (the
            learner fills them in per step).
        temperature: the run's sampling temperature (rollout.temperature): every token's where an
            experience has no `temperatures` of its own, and on padding.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if advantages is None:
        advantages = [0.0] * len(experiences)
    if len(advantages) != len(experiences):
        raise ValueError(
            f"need one advantage per experience, got {len(advantages)} advantages for "
            f"{len(experiences)} experiences"
        )
    lengths = [experience.num_tokens for experience in experiences]
    if min(lengths, default=1) < 1:
        raise ValueError("every experience needs at least one token; got an empty token_ids")
    groups = _group_by_budget(lengths, max_tokens_per_micro_batch, layout)
    micro_batches = [_collate(experiences, advantages, rows, pad_token_id, temperature, packed=layout != "padded")
                     for rows in groups]
    if num_micro_batches is not None:
        if num_micro_batches < len(micro_batches):
            raise ValueError(
                f"num_micro_batches={num_micro_batches} is fewer than the {len(micro_batches)} "
                f"these experiences need; pass the max of count_micro_batches over ranks"
            )
        num_empty = num_micro_batches - len(micro_batches)
        micro_batches.extend(_empty_micro_batch(pad_token_id, temperature, packed=layout != "padded")
                             for _ in range(num_empty))
    return micro_batches


def _group_by_budget(lengths: list[int], max_tokens: int, layout: str) -> list[list[list[int]]]:
    """Micro-batches, each a list of rows of experience indices, longest first within the budget.

    padded and rows: a micro-batch's width is its first (longest) experience; an experience joins
    the first row with room in any micro-batch (rows only), else a new row of the last micro-batch
    while rows x width fits the budget, else opens the next micro-batch. row: one row per
    micro-batch, first fit."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if layout == "row":
        rows: list[list[int]] = []
        used: list[int] = []
        for index in order:
            row = next((r for r, tokens in enumerate(used) if tokens + lengths[index] <= max_tokens), None)
            if row is None:
                rows.append([])
                used.append(0)
                row = len(rows) - 1
            rows[row].append(index)
            used[row] += lengths[index]
        return [[row] for row in rows]
    batches: list[list[list[int]]] = []
    used: list[list[int]] = []  # tokens in each row of each micro-batch
    for index in order:
        length = lengths[index]
        if layout == "rows":  # first fit into any row with room, earlier micro-batches first
            spot = next(((b, r) for b, rows in enumerate(used) for r, tokens in enumerate(rows)
                         if tokens + length <= lengths[batches[b][0][0]]), None)
            if spot is not None:
                batches[spot[0]][spot[1]].append(index)
                used[spot[0]][spot[1]] += length
                continue
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0][0]] <= max_tokens:
            batches[-1].append([index])
            used[-1].append(length)
            continue
        batches.append([[index]])
        used.append([length])
    return batches


def _collate(all_experiences: list[Experience], all_advantages: list[float], packed_rows: list[list[int]],
             pad_token_id: int, temperature: float, packed: bool) -> MicroBatch:
    rows = [index for packed_row in packed_rows for index in packed_row]  # one padded row per experience
    experiences = [all_experiences[i] for i in rows]
    advantages = [all_advantages[i] for i in rows]
    num_rows, seq_len = len(experiences), max(e.num_tokens for e in experiences)
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((num_rows, seq_len), dtype=torch.long)
    action_mask = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    behavior_logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    temperatures = torch.full((num_rows, seq_len), temperature, dtype=torch.float32)
    for row, experience in enumerate(experiences):
        n = experience.num_tokens
        input_ids[row, :n] = torch.tensor(experience.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        action_mask[row, :n] = torch.tensor(experience.action_mask, dtype=torch.float32)
        behavior_logprobs[row, :n] = torch.tensor(experience.behavior_logprobs, dtype=torch.float32)
        if experience.temperatures is not None:
            temperatures[row, :n] = torch.tensor(experience.temperatures, dtype=torch.float32)
    row_advantages = torch.tensor(advantages, dtype=torch.float32)[:, None]  # [batch, 1]
    micro_batch = MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        behavior_logprobs=behavior_logprobs * action_mask,
        advantages=row_advantages * action_mask,
        temperatures=temperatures,
        rewards=torch.tensor([e.reward for e in experiences], dtype=torch.float64),
        truncated=torch.tensor([e.truncated for e in experiences], dtype=torch.bool),
        rows=rows,
        routed_experts=_collate_routes(experiences, seq_len),
        image_inputs=_collate_images(experiences),
    )
    if packed:
        lengths = [[all_experiences[i].num_tokens for i in packed_row] for packed_row in packed_rows]
        _pack(micro_batch, lengths, pad_token_id)
    return micro_batch


def _collate_routes(experiences: list[Experience], seq_len: int) -> torch.Tensor | None:
    """[batch, seq, layers, top_k] the experiences' routes, -1 on padding and for one without any;
    None when none has any."""
    shapes = {tuple(e.routed_experts.shape[1:]) for e in experiences if e.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"experiences of one micro-batch have routes of different [layers, top_k]: {sorted(shapes)}; "
                         f"all must come from one model's engine")
    routes = torch.full((len(experiences), seq_len, *shapes.pop()), UNKNOWN, dtype=ROUTE_DTYPE)
    for row, experience in enumerate(experiences):
        if experience.routed_experts is not None:
            routes[row, :experience.num_tokens] = experience.routed_experts
    return routes


def _collate_images(experiences: list[Experience]) -> dict[str, torch.Tensor] | None:
    """The experiences' image tensors concatenated in row order; None when none has images."""
    images = [e.images for e in experiences if e.images is not None and e.images.num_images]
    if not images:
        return None
    names = set(images[0].tensors)
    if any(set(image.tensors) != names for image in images):
        raise ValueError(f"experiences of one micro-batch hold different image tensors "
                         f"{sorted({tuple(sorted(image.tensors)) for image in images})}; all must come from one "
                         f"model's processor")
    return {name: torch.cat([image.tensors[name] for image in images]) for name in sorted(names)}


def _pack(micro_batch: MicroBatch, lengths: list[list[int]], pad_token_id: int) -> None:
    """Fill the packed layout: packed row r holds the sequences of `lengths[r]` back to back (padded
    rows in the same order), then a pad tail numbered as a sequence of its own."""
    width, seq_len = max(sum(row) for row in lengths), micro_batch.input_ids.shape[1]
    indices, positions, padded_row = [], [], 0
    for row in lengths:
        for length in row:
            indices.append(padded_row * seq_len + torch.arange(length))
            positions.append(torch.arange(length))
            padded_row += 1
        tail = width - sum(row)
        indices.append(torch.full((tail,), -1, dtype=torch.long))
        positions.append(torch.arange(tail))
    packed_index = torch.cat(indices)
    real = packed_index >= 0
    packed_ids = torch.full((len(lengths) * width,), pad_token_id, dtype=torch.long)
    packed_ids[real] = micro_batch.input_ids.reshape(-1)[packed_index[real]]
    micro_batch.packed_ids = packed_ids.view(len(lengths), width)
    micro_batch.position_ids = torch.cat(positions).view(len(lengths), width)
    micro_batch.packed_index = packed_index


def _empty_micro_batch(pad_token_id: int, temperature: float, packed: bool) -> MicroBatch:
    # The filler token is marked real (attention 1) so attention never sees a fully masked row,
    # which would put NaNs into the forward; with no action tokens it adds nothing to the loss.
    micro_batch = MicroBatch(
        input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long),
        attention_mask=torch.ones((1, 1), dtype=torch.long),
        action_mask=torch.zeros((1, 1)),
        behavior_logprobs=torch.zeros((1, 1)),
        advantages=torch.zeros((1, 1)),
        temperatures=torch.full((1, 1), temperature, dtype=torch.float32),
        rewards=torch.zeros(1, dtype=torch.float64),
        truncated=torch.zeros(1, dtype=torch.bool),
        rows=[-1],
    )
    if packed:
        _pack(micro_batch, [[1]], pad_token_id)
    return micro_batch
