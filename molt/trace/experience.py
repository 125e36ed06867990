"""The trace: one experience per trajectory segment (DESIGN section 5)."""

from __future__ import annotations

import copy
import dataclasses
import math
import zlib
from dataclasses import dataclass, field, fields

import torch

from molt.trace.images import ImageInputs, concat_image_inputs
from molt.trace.routes import count_known, decode_routes, encode_routes, merge_routes, pad_routes


@dataclass(kw_only=True)
class Experience:
    """One trajectory segment: the token stream the policy saw and what it sampled.

    Token-axis fields all have the same length (`num_tokens`). Lists, not tensors, because the
    record travels over ZeroMQ as msgpack; the trainer turns it into tensors once.
    """

    token_ids: list[int]  # [tokens] prompt, context and sampled tokens in order
    action_mask: list[int]  # [tokens] 1 where the policy sampled the token
    behavior_logprobs: list[float]  # [tokens] engine log-prob of each sampled token, 0 elsewhere
    policy_versions: list[int]  # [tokens] weight version that sampled each action token, -1 elsewhere
    # None: rollout.temperature for every token (the common case, which ships nothing). Only the
    # action tokens' values matter; context positions are masked out of every loss.
    temperatures: list[float] | None = None  # [tokens] temperature each token was sampled at
    # Routed experts (molt.trace.routes): each token's top-k experts at each MoE layer as the engine ran
    # it, -1 where unknown; None for a dense model or with rollout.capture_routes off. A tensor, as
    # a list of lists would be most of the record; to_dict ships its raw bytes. Left out of `==`
    # (a tensor has no single truth value): compare it with torch.equal.
    routed_experts: torch.Tensor | None = field(default=None, compare=False)  # [tokens, layers, top_k] int16
    # The images the prompt and observations held (molt.trace.images): their files and the processor's
    # tensors; None for a text-only segment. Token ids hold their expanded placeholders.
    images: ImageInputs | None = field(default=None, compare=False)
    reward: float  # the rollout's reward, shared by all its segments
    score: float  # value used for group filtering; defaults to the reward
    group_id: int  # prompt group this rollout belongs to
    rollout_id: int  # unique per rollout; segments of one rollout share it
    segment_index: int = 0  # position of this segment within its rollout
    truncated: bool = False  # the last response was cut at max_response_tokens or max_length
    info: dict[str, float] = field(default_factory=dict)  # numeric metrics from the agent
    # CRC32 of the action tokens' (position, id) pairs, taken where the trace is made
    # (compute_action_digest): the trainer checks the ids it trains on against it (molt.trainer.diagnostics).
    # None: not checked. Whatever changes token_ids or action_mask must recompute or clear it.
    action_digest: int | None = None
    # While offloaded (molt.transport.payloads.fields): the token-axis lists are empty, `payload` is the
    # reference to them in the producing node's payload store, and `summary` keeps what the
    # controller needs without them (see summarize_tokens).
    payload: dict | None = None
    summary: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.temperatures is not None and len(self.temperatures) != len(self.token_ids):
            raise ValueError(f"temperatures has {len(self.temperatures)} entries for {len(self.token_ids)} tokens; "
                             f"give one per token, or None for rollout.temperature everywhere")
        if self.routed_experts is not None and len(self.routed_experts) != len(self.token_ids):
            raise ValueError(f"routed_experts has {len(self.routed_experts)} positions for {len(self.token_ids)} "
                             f"tokens; give one per token (-1 where unknown), or None without routes")

    @property
    def num_tokens(self) -> int:
        return self.summary["num_tokens"] if self.summary else len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return self.summary["num_action_tokens"] if self.summary else sum(self.action_mask)

    @property
    def num_routed_tokens(self) -> int:
        """Positions with a known route (0 without routes)."""
        return self.summary.get("num_routed_tokens", 0) if self.summary else count_known(self.routed_experts)

    @property
    def num_images(self) -> int:
        """Images the segment shows (0 without any); known from the summary while offloaded."""
        return self.summary.get("num_images", 0) if self.summary else (self.images.num_images if self.images else 0)

    @property
    def image_bytes(self) -> int:
        """Bytes of the images' files and processor tensors (ImageInputs.nbytes), what they add to a payload."""
        return self.summary.get("image_bytes", 0) if self.summary else (self.images.nbytes if self.images else 0)

    def action_version_stats(self) -> tuple[int, int, int, int]:
        """(count, sum, min, max) of the action tokens' policy versions ((0, 0, 0, 0) without any)."""
        summary = self.summary or summarize_tokens(self)
        return (summary["num_action_tokens"], summary["version_sum"], summary["version_min"],
                summary["version_max"])

    def to_dict(self) -> dict:
        """The fields for msgpack. Shallow: the dict shares this record's lists and dicts (asdict's
        deep copy was most of the cost of forwarding an outcome); the routes as raw bytes."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["routed_experts"] = encode_routes(self.routed_experts)
        data["images"] = self.images.to_dict() if self.images is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Experience:
        return cls(**{**data, "routed_experts": decode_routes(data.get("routed_experts")),
                      "images": ImageInputs.from_dict(data.get("images"))})


def summarize_tokens(experience: Experience) -> dict[str, int]:
    """What the controller reads of the token-axis fields: their length, the action-token count,
    the action tokens' policy versions (sum, min, max) for the staleness metrics, how many
    positions have a known route, and the images' count and bytes (the images stay in the payload)."""
    versions = [v for is_action, v in zip(experience.action_mask, experience.policy_versions) if is_action]
    return {"num_tokens": len(experience.token_ids), "num_action_tokens": len(versions),
            "version_sum": sum(versions), "version_min": min(versions, default=0),
            "version_max": max(versions, default=0), "num_routed_tokens": count_known(experience.routed_experts),
            "num_images": experience.num_images, "image_bytes": experience.image_bytes}


def compute_action_digest(token_ids, action_mask) -> int:
    """CRC32 of the action tokens' (position, id) pairs as little-endian int64: the fingerprint of
    what the engine sampled (`Experience.action_digest`). Lists, arrays or CPU tensors, [tokens] each."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    positions = torch.as_tensor(action_mask).bool().nonzero().view(-1)
    pairs = torch.stack([positions, ids[positions]], dim=1)  # [action tokens, 2]
    return zlib.crc32(pairs.numpy().astype("<i8", copy=False).tobytes())


@dataclass
class Segment:
    """Token-axis buffers of a segment while its rollout runs (the Env runner and a chat session
    both build one); it becomes an Experience when the rollout ends."""

    token_ids: list[int] = field(default_factory=list)  # [tokens]
    action_mask: list[int] = field(default_factory=list)  # [tokens]
    logprobs: list[float] = field(default_factory=list)  # [tokens]
    versions: list[int] = field(default_factory=list)  # [tokens]
    temperatures: list[float] = field(default_factory=list)  # [tokens] sampling temperature; 1.0 on context
    truncated: bool = False  # its last response was cut at max_tokens
    # The routes recorded so far (molt.trace.routes), None until a generation brings some. Shorter than
    # token_ids while context added after the last generation has not been run by the engine.
    routes: torch.Tensor | None = field(default=None, compare=False)  # [tokens recorded, layers, top_k] int16
    images: ImageInputs | None = field(default=None, compare=False)  # the images of its context, in order

    def add_context(self, token_ids: list[int], images: ImageInputs | None = None) -> None:
        """Append context tokens; `images`: those whose placeholders they hold, positions relative to
        the first of them."""
        if images is not None and images.num_images:
            self.images = concat_image_inputs([self.images, images], [0, len(self.token_ids)])
        # Context positions are masked out of every loss; any positive temperature keeps their
        # (discarded) log-probs finite.
        self.token_ids += token_ids
        self.action_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        self.temperatures += [1.0] * len(token_ids)

    def add_action(self, token_ids: list[int], logprobs: list[float], versions: int | list[int],
                   temperature: float = 1.0, routes: torch.Tensor | None = None) -> None:
        """Append sampled tokens; `versions`: the weight version of each token, or one for all;
        `temperature`: the one they were sampled at (their `logprobs` are at it too); `routes`: the
        generation's routed experts, [all tokens so far, these included, layers, top_k] (`record_routes`)."""
        if isinstance(versions, int):
            versions = [versions] * len(token_ids)
        if not len(token_ids) == len(logprobs) == len(versions):
            raise RuntimeError(f"engine returned {len(token_ids)} tokens but {len(logprobs)} logprobs "
                               f"and {len(versions)} versions")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature={temperature}: sampled tokens need a positive, finite temperature for "
                             f"the trainer to recompute their log-probs (greedy, temperature 0, has none)")
        self.token_ids += token_ids
        self.action_mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.versions += versions
        self.temperatures += [float(temperature)] * len(token_ids)
        if routes is not None:
            self.record_routes(routes)

    def record_routes(self, routes: torch.Tensor) -> None:
        """Merge a generation's routes (its prompt, which is this segment's tokens before its reply,
        and its reply) into the segment's. First recorded wins (merge_routes): a continuation or a
        partial rollout's recomputed prefix keeps the routes of the weights that ran it first, and a
        prefix-cache hit's unknown positions are filled by what was recorded before."""
        if len(routes) != len(self.token_ids):
            raise RuntimeError(f"the engine returned routes for {len(routes)} positions, but the prompt and reply "
                               f"have {len(self.token_ids)} tokens; routed_experts must cover prompt and reply")
        self.routes = merge_routes(self.routes, routes)

    def routes_or_none(self) -> torch.Tensor | None:
        """[tokens, layers, top_k] the routes, for `Experience.routed_experts`, unknown (-1) past the
        last generation; None when no generation brought any."""
        return None if self.routes is None else pad_routes(self.routes, len(self.token_ids))

    def action_temperatures_or_none(self, default: float) -> list[float] | None:
        """[tokens] the temperatures, for `Experience.temperatures`, when some action token was
        sampled at one other than `default` (rollout.temperature); else None, which ships nothing."""
        differs = any(is_action and t != default for is_action, t in zip(self.action_mask, self.temperatures))
        return list(self.temperatures) if differs else None

    def copy(self) -> Segment:
        # The images are shared: nothing changes them in place (add_context makes new ones).
        return copy.deepcopy(self, {id(self.images): self.images})

    def to_dict(self) -> dict:
        """The fields for msgpack (a session's segments go from the rank to the agent worker)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "routes": encode_routes(self.routes),
                "images": self.images.to_dict() if self.images is not None else None}

    @classmethod
    def from_dict(cls, data: dict) -> Segment:
        return cls(**{**data, "routes": decode_routes(data.get("routes")),
                      "images": ImageInputs.from_dict(data.get("images"))})


def split_at_version_changes(experience: Experience) -> list[Experience]:
    """The experience as pieces whose action tokens each have one policy version (DESIGN section 6:
    without partial rollout no experience spans two versions). A multi-turn rollout whose next turn
    ran under a new version is closed after the last token of the old version, and the new piece
    starts over from the same tokens with everything earlier as context (action mask 0, log-prob 0,
    version -1): the earlier turns become context of the new segment, and each action token is
    trained exactly once. An experience of a single version comes back as it is. Pieces keep the
    rollout, group, reward and score; `segment_index` is left to the caller; only the last piece
    keeps `truncated` (it describes the rollout's last response)."""
    runs: list[tuple[int, int]] = []  # (version, index of its last action token), in order
    for index, (is_action, version) in enumerate(zip(experience.action_mask, experience.policy_versions)):
        if not is_action:
            continue
        if runs and runs[-1][0] == version:
            runs[-1] = (version, index)
        else:
            runs.append((version, index))
    if len(runs) <= 1:
        return [experience]
    pieces, start = [], 0
    for number, (version, last) in enumerate(runs):
        is_last = number == len(runs) - 1
        end = experience.num_tokens if is_last else last + 1
        mine = [bool(experience.action_mask[i]) and i >= start for i in range(end)]
        pieces.append(dataclasses.replace(
            experience, token_ids=experience.token_ids[:end], action_mask=[int(m) for m in mine],
            behavior_logprobs=[lp if m else 0.0 for lp, m in zip(experience.behavior_logprobs, mine)],
            policy_versions=[v if m else -1 for v, m in zip(experience.policy_versions, mine)],
            temperatures=None if experience.temperatures is None else experience.temperatures[:end],
            routed_experts=None if experience.routed_experts is None else experience.routed_experts[:end],
            images=None if experience.images is None else experience.images.before(end),
            action_digest=None if experience.action_digest is None else compute_action_digest(
                experience.token_ids[:end], mine),
            truncated=experience.truncated and is_last, info=dict(experience.info)))
        start = last + 1
    return pieces
