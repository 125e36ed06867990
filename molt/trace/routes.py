"""Routed experts in a trace (DESIGN section 5): for every token of a segment, at every MoE layer,
the top-k expert ids the engine routed it to, as a [tokens, layers, top_k] int16 tensor; -1 where
the route is unknown (the last sampled token, which the engine never runs through the model; a
dense layer; a prefix-cache hit on a block no worker recorded, which is rare: workers keep the
routes of the cache blocks they computed, molt.rollout.route_capture).

Position p's route is the one computed when the engine ran token p through the model, i.e. in the
forward that produced the distribution token p + 1 was sampled from. Routing replay (R3, Ma et al.
2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers") makes
the trainer's forward use the same experts at every position that has one.

A position keeps the first route recorded for it: a later request that runs the same tokens again
(a multi-turn continuation whose prefix fell out of the cache, a partial rollout retained across a
refit, which recomputes its prefix under the new weights) does not overwrite it, so each token keeps
the route of the weights that ran it first.
"""

from __future__ import annotations

import torch

ROUTE_DTYPE = torch.int16  # expert ids; 32767 experts is more than any model has
UNKNOWN = -1


def unknown_routes(num_tokens: int, num_layers: int, top_k: int) -> torch.Tensor:
    """[num_tokens, num_layers, top_k] all unknown."""
    return torch.full((num_tokens, num_layers, top_k), UNKNOWN, dtype=ROUTE_DTYPE)


def merge_routes(recorded: torch.Tensor | None, fresh: torch.Tensor) -> torch.Tensor:
    """[len(fresh), layers, top_k]: `recorded`'s route at each position it covers and knows (the
    first recorded wins), `fresh`'s elsewhere. `recorded` may be shorter than `fresh` (the tokens
    appended since), never longer."""
    if recorded is None or not len(recorded):
        return fresh.to(ROUTE_DTYPE)
    if len(recorded) > len(fresh) or recorded.shape[1:] != fresh.shape[1:]:
        raise ValueError(f"cannot merge routes {tuple(recorded.shape)} into {tuple(fresh.shape)}: the recorded "
                         f"routes must cover a prefix of the same layers and top-k")
    merged = fresh.to(ROUTE_DTYPE).clone()
    prefix = merged[:len(recorded)]
    known = recorded[:, :, :1] != UNKNOWN  # a position's layers and slots are known together or not at all
    merged[:len(recorded)] = torch.where(known, recorded, prefix)
    return merged


def pad_routes(routes: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`routes` extended with unknown positions (or cut) to `num_tokens`."""
    if len(routes) >= num_tokens:
        return routes[:num_tokens]
    tail = unknown_routes(num_tokens - len(routes), routes.shape[1], routes.shape[2])
    return torch.cat([routes.to(ROUTE_DTYPE), tail])


def count_known(routes: torch.Tensor | None) -> int:
    """Positions with a recorded route."""
    return 0 if routes is None else int((routes[:, 0, 0] != UNKNOWN).sum())


def encode_routes(routes: torch.Tensor | None) -> dict | None:
    """The msgpack form of a routes tensor: its shape and raw int16 bytes (None stays None)."""
    if routes is None:
        return None
    return {"shape": list(routes.shape), "data": routes.to(ROUTE_DTYPE).contiguous().numpy().tobytes()}


def decode_routes(data: dict | torch.Tensor | None) -> torch.Tensor | None:
    """Undo `encode_routes` (a tensor passes through)."""
    if data is None or isinstance(data, torch.Tensor):
        return data
    flat = torch.frombuffer(bytearray(data["data"]), dtype=ROUTE_DTYPE) if data["data"] else \
        torch.empty(0, dtype=ROUTE_DTYPE)
    return flat.view(*data["shape"])
