"""Routing replay in the trainer (R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers") and what the trainer sees of the engine's routes.

An MoE layer's router picks each token's top-k experts. The engine and the trainer compute the
router logits with different kernels (and often dtypes), so near-ties fall differently: the
trainer then scores a token through other experts than the ones that sampled it, and the
trainer-vs-behaviour log-prob gap grows far beyond a dense model's. With replay on, each router
here uses the experts the engine recorded for a position (molt.trace.routes) and live routing where none
was recorded; the gate weights are still the live router's probabilities of the chosen experts,
so the router keeps its gradient.

Whether replay is on or off, every forward that has routes measures, at the positions that predict
an action token (position t - 1 for action token t: its logits are what the loss scores),
- route alignment: per MoE layer, the share whose live top-k (as a set) equals the recorded one;
- coverage: the share with a recorded route.
The router also hands its logits to the model's own load-balancing loss when that is on.

Router modules are found by their shape: a `gate` under a decoder block's `mlp` with `top_k`,
`num_experts` and a [num_experts, hidden] `weight`, whose forward returns (logits, gate weights,
expert ids), as transformers' Qwen3-MoE (and Qwen2-MoE, OLMoE-style) routers do.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from molt.trace.routes import UNKNOWN

if TYPE_CHECKING:
    from molt.trainer.diagnostics import StepDiagnostics


def find_routers(model: nn.Module) -> dict[int, nn.Module]:
    """The MoE routers of a Hugging Face causal LM by decoder layer index (the routes' layer axis
    counts every decoder layer; a dense layer's routes stay unknown)."""
    backbone = getattr(model, "model", model)
    routers = {}
    for index, block in enumerate(getattr(backbone, "layers", [])):
        gate = getattr(getattr(block, "mlp", None), "gate", None)
        if gate is not None and all(hasattr(gate, name) for name in ("top_k", "num_experts", "weight")):
            routers[index] = gate
    return routers


class RoutingReplay:
    """Installed once on a model's routers (`install`); `use(...)` around each micro-batch's forward
    and backward hands them that micro-batch's recorded routes.

    `replay`: route by the recorded experts (algorithm.routing_replay); False only measures.
    `aux_loss_coef`: the weight of the model's load-balancing loss; > 0 keeps each forward's
    router logits for `load_balancing_loss`."""

    def __init__(self, routers: dict[int, nn.Module], *, replay: bool, aux_loss_coef: float = 0.0) -> None:
        self.routers = routers  # decoder layer index -> router
        self.replay = replay
        self.aux_loss_coef = aux_loss_coef
        first = next(iter(routers.values()))
        self.top_k, self.num_experts = first.top_k, first.num_experts
        self._routes: torch.Tensor | None = None  # [positions, layers, top_k] long, the forward's layout
        self._scored: torch.Tensor | None = None  # [positions] bool: predicts an action token
        self._counts: dict[str, torch.Tensor] = {}
        self._logits: list[torch.Tensor] = []

    @classmethod
    def install(cls, model: nn.Module, *, replay: bool, aux_loss_coef: float | None = 0.0) -> RoutingReplay | None:
        """Patch every router's forward; None for a model without routers (on which `replay` and a
        positive `aux_loss_coef` are refused). `aux_loss_coef` None takes the model config's
        router_aux_loss_coef (algorithm.router_aux_loss_coef)."""
        routers = find_routers(model)
        if not routers:
            asked = {"algorithm.routing_replay": replay, "algorithm.router_aux_loss_coef": aux_loss_coef or None}
            asked = {name: value for name, value in asked.items() if value}
            if asked:
                raise ValueError(f"{', '.join(f'{k}={v}' for k, v in asked.items())}: {type(model).__name__} has no "
                                 f"mixture-of-experts router Molt recognises (an `mlp.gate` with top_k and "
                                 f"num_experts); leave them unset for a dense model")
            return None
        if aux_loss_coef is None:
            aux_loss_coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
        replay_routes = cls(routers, replay=replay, aux_loss_coef=aux_loss_coef)
        for order, (layer, router) in enumerate(routers.items()):
            router.forward = functools.partial(_route, router, replay_routes, layer, order)
        return replay_routes

    @contextlib.contextmanager
    def use(self, routes: torch.Tensor | None, scored: torch.Tensor, attention_mask: torch.Tensor | None
            ) -> Iterator[None]:
        """Within: the routers see `routes` ([rows, width, layers, top_k], laid out like the model's
        input, -1 unknown; None = live routing everywhere) and `scored` ([rows, width] bool, the
        positions that predict an action token). Wrap the backward too: activation checkpointing
        reruns the forward then, and it must route the same way. Counts and logits restart here."""
        self._routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:]).long()
        self._scored = scored.reshape(-1)
        self._mask = attention_mask
        self._counts, self._logits = {}, []
        try:
            yield
        finally:
            self._routes = self._scored = self._mask = None
            self._logits = []

    def take_counts(self) -> dict[str, torch.Tensor]:
        """The last forward's counts (float64): `route_matched` and `route_compared` [MoE layers, in
        order] (scored positions with a recorded route whose live top-k equals it / all of them),
        `route_covered` and `route_scored` (scored positions with a recorded route at the first MoE
        layer / all of them)."""
        counts, self._counts = self._counts, {}
        return counts

    def report(self, diagnostics: StepDiagnostics | None) -> None:
        """Hand the last forward's counts to the step's diagnostics (when given), as route alignment
        (overall and `route_alignment/layer_<i>`) and `r3_coverage`; forget them either way."""
        counts = self.take_counts()
        if diagnostics is None or not counts:
            return
        matched, compared = counts["route_matched"], counts["route_compared"]
        diagnostics.add_counts("route_alignment", matched.sum(), compared.sum())
        for order, layer in enumerate(self.routers):
            diagnostics.add_counts(f"route_alignment/layer_{layer}", matched[order], compared[order])
        diagnostics.add_counts("r3_coverage", counts["route_covered"], counts["route_scored"])

    def load_balancing_loss(self) -> torch.Tensor | None:
        """The model's own auxiliary load-balancing loss over the last forward's router logits
        (transformers' `load_balancing_loss_func` of the model's module), or None if not kept."""
        if not self._logits:
            return None
        module = sys.modules[type(next(iter(self.routers.values()))).__module__]
        logits = tuple(self._logits)
        self._logits = []
        return module.load_balancing_loss_func(logits, self.num_experts, self.top_k, self._mask)

    def _record(self, order: int, live: torch.Tensor, recorded: torch.Tensor | None) -> None:
        """Count, at the scored positions, which recorded routes the live router of the `order`-th
        MoE layer agrees with (the first one starts a forward's counts)."""
        scored = self._scored
        if scored is None or scored.numel() != live.shape[0]:
            return
        num_layers = len(self.routers)
        if order == 0:
            device = live.device
            self._counts = {"route_matched": torch.zeros(num_layers, dtype=torch.float64, device=device),
                            "route_compared": torch.zeros(num_layers, dtype=torch.float64, device=device),
                            "route_covered": torch.zeros((), dtype=torch.float64, device=device),
                            "route_scored": scored.sum().to(torch.float64)}
        if not self._counts:
            return
        if recorded is None:
            return
        known = (recorded[:, 0] != UNKNOWN) & scored
        same = (live.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1) & known
        self._counts["route_matched"][order] += same.sum()
        self._counts["route_compared"][order] += known.sum()
        if order == 0:
            self._counts["route_covered"] += known.sum()


def _route(router: nn.Module, replay: RoutingReplay, layer: int, order: int, hidden_states: torch.Tensor):
    """The router's forward (transformers' top-k router: softmax over the experts, top-k,
    renormalised when norm_topk_prob) with each position's experts taken from its recorded route
    when replay is on and it has one. `layer`: the decoder layer (the routes' layer axis); `order`:
    which MoE layer this is."""
    hidden_states = hidden_states.reshape(-1, router.weight.shape[-1])
    logits = F.linear(hidden_states, router.weight)  # [positions, experts]
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    live = torch.topk(probs, router.top_k, dim=-1).indices  # [positions, top_k]
    recorded = replay._routes
    if recorded is not None and (recorded.shape[0] != live.shape[0] or recorded.shape[1] <= layer):
        raise RuntimeError(f"routing replay: the router of decoder layer {layer} got {live.shape[0]} positions, but "
                           f"the micro-batch's routes are {list(recorded.shape)} ([positions, layers, top_k])")
    recorded = None if recorded is None else recorded[:, layer]
    replay._record(order, live, recorded)
    chosen = live
    if replay.replay and recorded is not None:
        chosen = torch.where(recorded[:, :1] != UNKNOWN, recorded, live)
    weights = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if replay.aux_loss_coef > 0:
        replay._logits.append(logits)
    return logits, weights.to(logits.dtype), chosen
