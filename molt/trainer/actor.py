"""The FSDP2 actor: a Hugging Face causal LM laid out on the trainer mesh, its optimizer and loss."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from molt.distributed.expert_parallel import freeze_routers
from molt.distributed.parallelize import ShardingPlan, TrainerMesh, shard_model
from molt.models.hf_checkpoint import build_empty_model, load_sharded_weights
from molt.models.vision_language import format_image_inputs, text_backbone, vision_tower
from molt.objectives import (aggregate_tokens, compute_cispo_loss, compute_entropy_bonus, compute_gspo_loss,
                             compute_importance_weights, compute_kl_estimate, compute_loss_denominator,
                             compute_ppo_clip_loss, compute_trust_region_weights, count_sequences,
                             token_entropy_from_logits)
from molt.trace.experience import Experience
from molt.trainer.batch import MicroBatch, build_micro_batches
from molt.trainer.diagnostics import StepDiagnostics
from molt.trainer.logprobs import check_temperature, compute_chunked_logprobs
from molt.trainer.optimizer import OptimizerSettings, build_optimizer
from molt.trainer.routing_replay import RoutingReplay

logger = logging.getLogger("molt")


def build_actor_model(model_path: str, *, mesh: TrainerMesh, device: torch.device, plan: ShardingPlan,
                      logprob_chunk_tokens: int = 1024, freeze_router: bool = False) -> nn.Module:
    """A Hugging Face causal LM (or vision-language model: molt.models.vision_language) laid out on `mesh`
    (the trainer ranks only) and loaded without ever holding the whole model on one rank.

    The model is built on the meta device, its LM head becomes a `ScoringHead` (chunked log-probs),
    `shard_model` applies tensor parallelism (when the mesh has tp > 1) and the plan (activation
    checkpointing, mixed precision, offload, one FSDP unit per decoder block and the root), and
    then each rank reads only its own slices of the safetensors files (molt.models.hf_checkpoint).
    Parameter names stay the Hugging Face names (neither adds wrapper prefixes), which is what
    vLLM's weight loading expects at refit. `freeze_router` (train.freeze_router): an MoE model's
    routers get no gradient and no update (molt.distributed.expert_parallel.freeze_routers).
    """
    model = build_empty_model(model_path, dtype=plan.param_dtype)
    backbone, vision = text_backbone(model), vision_tower(model)
    if vision is not None and mesh.tp_size > 1:
        raise ValueError(f"layout.trainer_tensor_parallel_size={mesh.tp_size}: {type(model).__name__} is a "
                         f"vision-language model, which Molt's trainer does not tensor-parallelise; use 1")
    install_scoring_head(model, chunk_tokens=logprob_chunk_tokens)
    if freeze_router:
        freeze_routers(backbone)
    shard_and_load(model, backbone, model_path, mesh=mesh, device=device, plan=plan)
    if vision is not None:
        # The vision tower and connector stay in the root FSDP unit, gathered on every rank at every
        # forward: a rank whose micro-batch holds no image skips them, so a unit of their own would
        # miss its all-gather there. Such a rank's unused vision parameters then reduce zero gradients,
        # so every rank reduce-scatters the same parameters.
        model.set_reduce_scatter_unused_params(True)
    if model.config.tie_word_embeddings and model.get_output_embeddings() is not None:
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("sharding untied the input and output embeddings of a tied model")
    return model


def shard_and_load(model: nn.Module, backbone: nn.Module, model_path: str, *, mesh: TrainerMesh,
                   device: torch.device, plan: ShardingPlan, not_in_checkpoint: str = "") -> None:
    """The steps every trainer model shares, on a model built on the meta device: pick the
    attention implementation, lay it out with `shard_model` (tensor parallelism over the backbone
    and heads, then one FSDP unit per block of `backbone.layers` and the root), and fill each
    rank's shards from `model_path`. Parameters the checkpoint lacks stop the start, except those
    named with the prefix `not_in_checkpoint` (the critic's value head)."""
    if device.type != mesh.device_type:
        raise ValueError(f"device {device} does not match the mesh's device type {mesh.device_type!r}")
    choose_attention(backbone, device, plan.forward_dtype)
    shard_model(model, backbone, mesh=mesh, plan=plan)
    report = load_sharded_weights(model, model_path, device=torch.device("cpu") if plan.cpu_offload else device)
    missing = [name for name in report.missing if not (not_in_checkpoint and name.startswith(not_in_checkpoint))]
    if missing:
        raise RuntimeError(f"{model_path} has no weights for {len(missing)} parameters of its own architecture, "
                           f"e.g. {missing[:3]}: is it a complete Hugging Face checkpoint?")


FLASH_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


def attention_implementation(device_type: str, compute_dtype: torch.dtype, flash_available: bool) -> str | None:
    """"flash_attention_2" on CUDA with flash-attn installed and a 16-bit compute dtype; else None,
    which keeps the model's own (Hugging Face's sdpa for the models Molt trains)."""
    # flash-attn's kernels take fp16 and bf16 only (flash_attn csrc/flash_attn/flash_api.cpp:
    # "FlashAttention only support fp16 and bf16 data type"); transformers 5.19 passes fp32 queries
    # through unchanged when the Linear weights are fp32 (transformers/integrations/flash_attention.py,
    # get_target_dtype) and only warns about the dtype (modeling_utils.py, _flash_attn_can_dispatch:
    # "Flash Attention 2 only supports torch.float16 and torch.bfloat16 dtypes"), so fp32 compute
    # would fail at the first forward.
    if device_type == "cuda" and flash_available and compute_dtype in FLASH_ATTENTION_DTYPES:
        return "flash_attention_2"
    return None


def choose_attention(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Set `attention_implementation`'s choice on `model`. Flash attention takes a packed row's
    per-sequence position ids as variable-length sequences; elsewhere Hugging Face's sdpa builds a
    [rows, 1, L, L] block-diagonal causal mask from them, and each packed row is only as wide as the
    longest experience (molt.trainer.batch.LAYOUTS "rows"), so its cost is rows x L^2. On CUDA, a warning
    says when and why flash attention is off. Not yet run on a GPU."""
    flash_available = importlib.util.find_spec("flash_attn") is not None
    implementation = attention_implementation(device.type, compute_dtype, flash_available)
    if device.type == "cuda" and implementation is None:
        reason = ("flash-attn is not installed (pip install flash-attn)" if not flash_available else
                  f"the compute dtype is {compute_dtype}, and flash-attn takes float16 or bfloat16 only "
                  f"(set train.compute_dtype=bfloat16)")
        logger.warning("attention: %s; using %s, which masks each packed row with a dense [rows, 1, L, L] "
                       "block-diagonal mask and packs rows only as wide as the longest experience (cost rows x L^2)",
                       reason, model.config._attn_implementation)
        return
    if implementation is None:
        return
    try:
        model.set_attn_implementation(implementation)
    except (ImportError, ValueError) as error:  # e.g. a flash-attn build that does not match torch
        logger.warning("attention: %s unavailable (%s); using %s, packed rows as wide as the longest experience",
                       implementation, error, model.config._attn_implementation)
        return
    logger.info("attention: %s (packed rows as variable-length sequences)", implementation)


class ScoringHead(nn.Module):
    """A causal LM's linear LM head that can also score tokens without materializing the logits.

    It takes the place of `lm_head` holding the same weight Parameter (so parameter names, tied
    embeddings and FSDP2 units are unchanged). Called plainly it returns logits, like the head it
    replaces; inside `scoring(...)` the model's forward returns, in place of the logits, each
    position's log-prob of its target token (and the entropy) computed in chunks of
    `chunk_tokens` positions (molt.trainer.logprobs), inside the root unit's forward, where FSDP2 has the
    weight gathered.

    Under tensor parallelism the weight is vocab-sharded over the tp ranks (like the embedding it
    may be tied to) and gathered whole here, and the hidden states arrive whole (the final norm
    gathers them, molt.distributed.parallelize): every tp rank computes the same log-probs, and the gather's
    backward hands each rank its vocab rows of the (identical) weight gradient. Simpler than a
    vocab-parallel loss, at the cost of one whole head weight per rank during the forward.
    """

    def __init__(self, weight: nn.Parameter, *, chunk_tokens: int) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_tokens = chunk_tokens
        # (targets [rows, len], temperature: one or [rows, len] per position, with_entropy)
        self.request: tuple[torch.Tensor, float | torch.Tensor, bool] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        if self.request is None:
            return F.linear(hidden, weight)
        targets, temperature, with_entropy = self.request
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.reshape(-1)
        logprobs, entropy = compute_chunked_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), temperature=temperature,
            chunk_tokens=self.chunk_tokens, with_entropy=with_entropy)
        columns = [logprobs, entropy] if with_entropy else [logprobs]
        # A fresh tensor, not a view: FSDP2 hooks the root module's outputs for backward.
        return torch.stack([column.view(hidden.shape[:-1]) for column in columns], dim=-1)  # [batch, seq, 1 or 2]


def install_scoring_head(model: nn.Module, *, chunk_tokens: int) -> None:
    """Replace the model's linear LM head by a `ScoringHead` over the same weight."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s LM head is {type(head).__name__}"
                         f"{' with a bias' if isinstance(head, nn.Linear) else ''}: Molt scores tokens with a "
                         f"bias-free linear head (the Hugging Face causal LMs it trains have one)")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits (final_logit_softcapping="
                         f"{model.config.final_logit_softcapping}), which Molt's chunked log-probs do not apply")
    model.set_output_embeddings(ScoringHead(head.weight, chunk_tokens=chunk_tokens))


def score_tokens(model: nn.Module, input_ids: torch.Tensor, *, temperature: float | torch.Tensor,
                 with_entropy: bool = False, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, image_inputs: dict[str, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, len] log p(token t | the tokens before it in its sequence) under logits / temperature
    (at least float32), and with `with_entropy` the entropy of that distribution; 0 at each
    sequence's first token (column 0, or where `position_ids` is 0 in a packed row).

    `temperature`: one for every token, or [rows, len] (like `input_ids`) the one each token was
    sampled at, which its log-prob and entropy are then taken at.

    A model with a `ScoringHead` computes both in chunks, never holding [tokens, vocab] logits; a
    plain Hugging Face model (tests, tools) goes through its full logits. Padded rows must be
    right-padded (positions then count from 0 in every row).

    `image_inputs`: a vision-language model's image tensors, concatenated over the images in the
    order of their placeholder tokens in `input_ids` read row by row (molt.trainer.batch.MicroBatch.image_inputs).
    """
    targets = torch.roll(input_ids, -1, dims=-1)  # position t predicts token t + 1
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != input_ids.shape:
            raise ValueError(f"temperature must be one number or [rows, len] = {tuple(input_ids.shape)} like "
                             f"input_ids, got {tuple(temperature.shape)}")
        temperature = torch.roll(temperature, -1, dims=-1)  # ...at the temperature token t + 1 was sampled at
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if image_inputs:
        inputs.update(format_image_inputs(model.config, image_inputs))
    head = model.get_output_embeddings()
    if isinstance(head, ScoringHead):
        head.request = (targets, temperature, with_entropy)
        try:
            scores = model(**inputs).logits  # [rows, len, 1 or 2]
        finally:
            head.request = None
        logprobs, entropy = scores[..., 0], scores[..., 1] if with_entropy else None
    else:
        check_temperature(temperature)
        logits = model(**inputs).logits
        divisor = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / divisor
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        entropy = token_entropy_from_logits(logits) if with_entropy else None
    return _align(logprobs, position_ids), _align(entropy, position_ids) if with_entropy else None


def _align(per_position: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Shift what position t computed for token t + 1 onto column t + 1; 0 at sequence starts."""
    shifted = F.pad(per_position[..., :-1], (1, 0))
    return shifted if position_ids is None else shifted.masked_fill(position_ids == 0, 0.0)


def compute_token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """[batch, seq] log p(input_ids[:, t] | input_ids[:, :t]) of right-padded rows; column 0 is 0."""
    return score_tokens(model, input_ids, attention_mask=attention_mask, temperature=temperature)[0]


def score_micro_batch(model: nn.Module, micro_batch: MicroBatch, *,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`score_tokens` of a micro-batch, padded or packed, as [batch, seq] rows, each token at the
    temperature it was sampled at (`MicroBatch.temperatures`)."""
    logprobs, entropy = score_tokens(model, temperature=micro_batch.model_temperatures(), with_entropy=with_entropy,
                                     **micro_batch.model_inputs())
    return micro_batch.to_rows(logprobs), micro_batch.to_rows(entropy) if with_entropy else None


@dataclass(kw_only=True)
class PolicyLoss:
    """Which terms make up the policy loss (docs/objectives.md); every term is aggregated over the
    window alike (`aggregation`, molt.objectives.compute_loss_denominator)."""

    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None = None
    importance: tuple[str, str, float, float] | None = None  # (level, mode, low, high); None = off
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # KL-to-reference term in the loss; needs MicroBatch.ref_logprobs when > 0
    kl_estimator: str = "k3"
    kl_clamp: float = 0.0  # cap on each token's k3 estimate (algorithm.kl_clamp); 0 = uncapped
    kind: str = "ppo"  # ppo | gspo | cispo (algorithm.policy_loss); dual_clip is PPO's only
    router_aux_coef: float = 0.0  # MoE: the model's load-balancing loss (needs Actor.routing keeping logits)
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | constant (algorithm.loss_aggregation)
    constant_tokens: int = 0  # constant aggregation: tokens per sequence in the divisor
    trust_region: tuple[float, float] | None = None  # (max_kl, weight_cap): sequence trust region; None = off

    @property
    def decoupled(self) -> bool:
        """The ratio is taken against the trainer's log-probs before the update (importance correction
        or trust region), not against the behaviour log-probs."""
        return self.importance is not None or self.trust_region is not None


def set_gradient_sum_reduction(model: nn.Module) -> None:
    """Make FSDP2 SUM gradients over the data-parallel ranks instead of averaging them.

    The losses divide by the window's GLOBAL action-token count, so each rank's gradient is
    already its share of the token mean and the shares must be summed. FSDP2 averages by default
    (divides by the data-parallel size); a divide factor of 1 turns that into a sum, and forcing
    plain SUM collectives keeps it a sum on every backend (gloo has no PREMUL_SUM; NCCL can use
    zero-copy SUM). Under HSDP both the reduce-scatter over dp_shard and the all-reduce over
    dp_replicate sum. Tensor-parallel ranks hold parts of one data-parallel rank, not more data:
    DTensor sums their partial gradients, and FSDP2 reduces over the dp dims only.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def compute_window_counts(
    micro_batches: list[MicroBatch], *, group: dist.ProcessGroup, device: torch.device
) -> tuple[int, int]:
    """The window's action tokens and sequences (rows with an action token) over all micro-batches
    and data-parallel ranks.

    One all-reduce over `group` (the data-parallel group: tp ranks share their data), before the
    first micro-batch, so every loss term of the window divides by numbers that do not depend on
    how the window is split (DESIGN section 8; molt.objectives.compute_loss_denominator).
    """
    local = [(micro_batch.num_action_tokens, count_sequences(micro_batch.action_mask)) for micro_batch in micro_batches]
    counts = torch.tensor([sum(column) for column in zip(*local)] if local else [0, 0], dtype=torch.int64,
                          device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    window_tokens, window_sequences = counts.tolist()
    if window_tokens == 0:
        logger.warning("optimizer window has no action tokens on any rank; its gradient is zero")
    return window_tokens, window_sequences


def compute_window_denominator(
    micro_batches: list[MicroBatch], *, group: dist.ProcessGroup, device: torch.device
) -> float:
    """The window's action-token count over all micro-batches and data-parallel ranks (at least 1):
    the token mean's denominator (`compute_window_counts`)."""
    window_tokens, _ = compute_window_counts(micro_batches, group=group, device=device)
    return float(max(window_tokens, 1))


def is_maximum(statistic: str) -> bool:
    """Statistics add across micro-batches, ranks and windows, except maxima (named "..._max")."""
    return statistic.endswith("_max")


@dataclass(kw_only=True)
class WindowResult:
    """One optimizer window: this window's statistics summed over micro-batches and ranks."""

    totals: dict[str, float]  # "loss" (the window's aggregated loss), "action_tokens", objective sums (and maxima)
    grad_norm: float  # global, before clipping (nan/inf when not finite)
    stepped: bool  # False: a non-finite loss or gradient norm on some rank; no optimizer step anywhere


def step_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float,
                   loss_is_finite: bool) -> tuple[float, bool]:
    """Clip the global gradient norm and step, unless the loss or the norm is not finite; zero the
    gradients either way. Returns (pre-clip norm, whether the optimizer stepped).

    Both inputs are the same on every rank (the loss all-reduced over the data-parallel ranks and
    computed alike by tp ranks, the norm from the partial norms over every dim of each parameter's
    mesh), so every rank takes the same decision without another collective: a NaN or
    inf on any rank skips the update everywhere, and bad weights never exist. `max_grad_norm <= 0` disables
    clipping (the norm is still measured).
    """
    by_mesh = group_by_grad_mesh(model)
    grad_norm = 0.0
    if by_mesh:
        norms = []
        for parameters in by_mesh:
            norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # partial norms -> mesh's
        total_norm = torch.linalg.vector_norm(torch.stack(norms))
        grad_norm = total_norm.item()
    stepped = loss_is_finite and math.isfinite(grad_norm)
    if stepped:
        for parameters in by_mesh if max_grad_norm > 0 else ():
            torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm, total_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def group_by_grad_mesh(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters with a gradient, one list per device mesh of their (DTensor) gradients:
    expert parallelism puts the experts on a mesh of their own, and DTensor's norm and foreach
    ops take one mesh at a time."""
    groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            groups.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    return list(groups.values())


class TrainableModel:
    """An FSDP2 model with its own AdamW (molt.trainer.optimizer) and one optimizer step per window;
    gradients are summed across the data-parallel ranks (the losses divide by the window's global
    token count). The LR schedule advances once per training step (`advance_schedule`).

    `group` is the data-parallel group (TrainerMesh.dp_group: the ranks that train on different
    data), over which the window's token count and statistics are summed; under tensor parallelism
    it is not every trainer rank. Every method that runs the model is collective over the whole
    trainer mesh: all trainer ranks call it, the tp ranks of one data-parallel index with the same
    micro-batches, every rank with the same number of them.
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup, device: torch.device,
                 optimizer: OptimizerSettings, max_grad_norm: float = 1.0) -> None:
        self.model = model
        self.group = group
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.optimizer, self.scheduler = build_optimizer(model, optimizer)
        set_gradient_sum_reduction(model)

    def step_optimizer(self, loss_is_finite: bool = True) -> tuple[float, bool]:
        """See `step_optimizer`: (pre-clip norm, whether AdamW stepped)."""
        return step_optimizer(self.model, self.optimizer, max_grad_norm=self.max_grad_norm,
                              loss_is_finite=loss_is_finite)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def advance_schedule(self) -> None:
        """After a training step: the next step's learning rate."""
        self.scheduler.step()

    def schedule_state(self) -> dict:
        return {key: value for key, value in self.scheduler.state_dict().items() if key != "lr_lambdas"}

    def load_schedule_state(self, state: dict) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state})
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


class Actor(TrainableModel):
    """The policy being trained (see TrainableModel). Micro-batches are scored at their tokens' own
    sampling temperatures (`MicroBatch.temperatures`); `temperature`, the run's, is for
    `compute_logprobs` and the micro-batches built here (`choose_layout`). `routing`: an MoE
    model's routers (molt.trainer.routing_replay), handed each micro-batch's recorded routes."""

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, routing: RoutingReplay | None = None,
                 **settings) -> None:
        super().__init__(model, **settings)
        self.temperature = temperature
        self.routing = routing

    def routes_of(self, micro_batch: MicroBatch) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: its recorded routes for the routers (a no-op
        for a dense model)."""
        if self.routing is None:
            return contextlib.nullcontext()
        scored = micro_batch.model_layout(predicts_action(micro_batch.action_mask), fill=False)
        attention_mask = micro_batch.model_layout(micro_batch.attention_mask, fill=0)
        return self.routing.use(micro_batch.model_routed_experts(), scored, attention_mask)

    def train_window(self, micro_batches: list[MicroBatch], loss: PolicyLoss,
                     diagnostics: StepDiagnostics | None = None) -> WindowResult:
        """One optimizer step over the window's micro-batches (skipped if anything is not finite);
        `diagnostics`, when given, takes each micro-batch's log-probs and entropy (molt.trainer.diagnostics)."""
        sums = self.compute_window_gradients(micro_batches, loss, diagnostics)
        total = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            # every rank has the same terms, so the same names and the same collectives
            names = sorted(name for name in sums if is_maximum(name) == (op == dist.ReduceOp.MAX))
            if names:
                totals = torch.stack([sums[name] for name in names])
                dist.all_reduce(totals, op=op, group=self.group)
                total.update(zip(names, totals.tolist()))
        grad_norm, stepped = self.step_optimizer(loss_is_finite=math.isfinite(total["loss"]))
        return WindowResult(totals=total, grad_norm=grad_norm, stepped=stepped)

    def compute_window_gradients(self, micro_batches: list[MicroBatch], loss: PolicyLoss,
                                 diagnostics: StepDiagnostics | None = None) -> dict[str, torch.Tensor]:
        """Accumulate the gradient of the window's loss (aggregated per `loss.aggregation`) into `.grad`.

        Every token's term divides by a number made of the window's action-token and sequence counts
        over all micro-batches and ranks (all-reduced once, before the first micro-batch) and its own
        row's tokens (molt.objectives.compute_loss_denominator); importance and trust-region weights
        act inside each token's term and never change it. Returns this rank's float64 sums ("loss",
        "action_tokens", and the objectives' statistics; maxima for "..._max"); summed (maxed) over
        ranks they describe the window.
        """
        self.model.train()
        window_tokens, window_sequences = compute_window_counts(micro_batches, group=self.group, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(self.device)
            denominator = compute_loss_denominator(
                micro_batch.action_mask, aggregation=loss.aggregation, window_tokens=window_tokens,
                window_sequences=window_sequences, constant_tokens=loss.constant_tokens)
            with self.routes_of(micro_batch):  # activation checkpointing reruns the forward in backward
                terms, stats = self._micro_batch_loss(micro_batch, loss, denominator, diagnostics)
                total = sum(terms)
                total.backward()
            stats["loss"] = total.detach()
            for name, value in stats.items():
                value = value.detach().to(torch.float64)
                if name not in sums:
                    sums[name] = value
                else:
                    sums[name] = torch.maximum(sums[name], value) if is_maximum(name) else sums[name] + value
        return sums

    def _micro_batch_loss(self, micro_batch: MicroBatch, loss: PolicyLoss, denominator: float | torch.Tensor,
                          diagnostics: StepDiagnostics | None = None
                          ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The loss terms of one micro-batch and their statistics (masked sums). `denominator`: each
        token's divisor, one number or [rows, 1] (molt.objectives.compute_loss_denominator)."""
        mask = micro_batch.action_mask
        logprobs, entropy = score_micro_batch(self.model, micro_batch,
                                              with_entropy=loss.entropy_coef > 0 or diagnostics is not None)
        if diagnostics is not None:
            diagnostics.add_logprobs(logprobs, micro_batch.behavior_logprobs, entropy, mask)
        stats: dict[str, torch.Tensor] = {}
        aux_loss = None
        if self.routing is not None:
            self.routing.report(diagnostics)
            aux_loss = self.routing.load_balancing_loss()
        weights, ratio_base = None, micro_batch.behavior_logprobs
        if loss.decoupled:
            # Decoupled PPO: the ratio is taken against the proximal policy (the actor before the
            # step's first update: recorded by a no-grad pass when the step has several windows, the
            # current log-probs detached when it has one), and the engine/trainer mismatch is
            # corrected by each token's weight against the behaviour log-probs: the importance
            # correction's, then the trust region's, which rejects whole rows and caps the rest.
            ratio_base = micro_batch.proximal_logprobs
            if ratio_base is None:
                ratio_base = logprobs.detach()
        if loss.importance is not None:
            level, mode, low, high = loss.importance
            weights, importance_stats = compute_importance_weights(
                ratio_base, micro_batch.behavior_logprobs, mask, level=level, mode=mode, low=low, high=high)
            stats.update(importance_stats)
        if loss.trust_region is not None:
            max_kl, weight_cap = loss.trust_region
            weights, trust_stats = compute_trust_region_weights(
                ratio_base, micro_batch.behavior_logprobs, mask, max_kl=max_kl, weight_cap=weight_cap,
                importance_weights=weights)
            stats.update(trust_stats)
        clip = dict(clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high, denominator=denominator,
                    importance_weights=weights)
        if loss.kind == "ppo":
            policy, policy_stats = compute_ppo_clip_loss(logprobs, ratio_base, micro_batch.advantages, mask,
                                                         dual_clip=loss.dual_clip, **clip)
        else:
            compute = compute_gspo_loss if loss.kind == "gspo" else compute_cispo_loss
            policy, policy_stats = compute(logprobs, ratio_base, micro_batch.advantages, mask, **clip)
        stats.update(policy_stats)
        terms = [policy]
        if loss.kl_coef > 0:
            # compute_kl_loss's term, whose one-number denominator cannot take a per-row aggregation
            token_kl = compute_kl_estimate(logprobs, micro_batch.ref_logprobs, estimator=loss.kl_estimator,
                                           clamp=loss.kl_clamp)
            terms.append(loss.kl_coef * aggregate_tokens(token_kl, mask, denominator=denominator))
            stats["ref_kl_sum"] = aggregate_tokens(token_kl.detach(), mask, denominator=1.0)
        if loss.entropy_coef > 0:
            bonus, entropy_stats = compute_entropy_bonus(entropy, mask, coef=loss.entropy_coef,
                                                         denominator=denominator)
            terms.append(bonus)
            stats.update(entropy_stats)
        if loss.router_aux_coef > 0 and aux_loss is not None:
            # The model's per-token-mean auxiliary loss, weighted by this micro-batch's share of the
            # window's loss weight (its tokens' 1 / denominator), so it aggregates like every other term.
            share = aggregate_tokens(torch.ones_like(mask), mask, denominator=denominator)
            terms.append(loss.router_aux_coef * aux_loss * share)
            stats["router_aux_loss_sum"] = aux_loss.detach() * mask.sum()
        return terms, stats

    @torch.no_grad()
    def score(self, micro_batch: MicroBatch, diagnostics: StepDiagnostics | None = None) -> torch.Tensor:
        """[batch, seq] token log-probs of a micro-batch under the current weights (collective);
        `diagnostics`, when given, takes them with the entropy (molt.trainer.diagnostics)."""
        self.model.eval()
        micro_batch = micro_batch.to(self.device)
        with self.routes_of(micro_batch):
            logprobs, entropy = score_micro_batch(self.model, micro_batch, with_entropy=diagnostics is not None)
            if self.routing is not None:
                self.routing.report(diagnostics)
        if diagnostics is not None:
            diagnostics.add_logprobs(logprobs, micro_batch.behavior_logprobs, entropy, micro_batch.action_mask)
        # FSDP2 keeps the root unit's parameters gathered after a forward with no backward; a
        # later forward would then reuse them even after the optimizer changed the shards.
        self.model.reshard()
        return logprobs

    @torch.no_grad()
    def compute_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token log-probs of right-padded rows under the current weights, at `temperature`
        (collective)."""
        self.model.eval()
        logprobs = compute_token_logprobs(self.model, input_ids.to(self.device), attention_mask.to(self.device),
                                          temperature=self.temperature)
        self.model.reshard()  # see score
        return logprobs


def summarize_windows(results: list[WindowResult], loss: PolicyLoss, *, num_windows: int) -> dict[str, float]:
    """The step's policy metrics from its windows: per-token statistics pooled over every window
    run (all epochs), the loss and gradient norm averaged over them (so a non-finite one shows)."""
    total: dict[str, float] = {}
    for result in results:
        for name, value in result.totals.items():
            total[name] = max(total.get(name, value), value) if is_maximum(name) else total.get(name, 0.0) + value
    per_token = 1.0 / max(total.get("action_tokens", 0.0), 1.0)
    stepped = [result for result in results if result.stepped]
    metrics = {
        "loss": statistics.fmean(r.totals["loss"] for r in results),
        "grad_norm": statistics.fmean(r.grad_norm for r in results),
        "clip_fraction": total.get("clipped_tokens", 0.0) * per_token,
        "ratio_mean": total.get("ratio_sum", 0.0) * per_token,
        # KL(behaviour || trainer) per token: how far the engine's sampler is from the trainer.
        "mismatch_kl": total.get("mismatch_kl_sum", total.get("approx_kl_sum", 0.0)) * per_token,
        "num_action_tokens": sum(r.totals.get("action_tokens", 0.0) for r in results[:num_windows]),
        "optimizer_steps": float(len(stepped)),
    }
    if loss.dual_clip:
        metrics["dual_clip_fraction"] = total.get("dual_clipped_tokens", 0.0) * per_token
    if loss.importance:
        metrics["importance_rejected_share"] = total.get("rejected_tokens", 0.0) * per_token
        metrics["importance_weight_mean"] = total.get("weight_sum", 0.0) / max(total.get("kept_tokens", 0.0), 1.0)
    if loss.trust_region:
        sequences = max(total.get("trust_region_sequences", 0.0), 1.0)
        metrics["trust_region_rejected_share"] = total.get("trust_region_rejected_sequences", 0.0) / sequences
        metrics["trust_region_kl_mean"] = total.get("trust_region_kl_sum", 0.0) / sequences
        metrics["trust_region_kl_max"] = total.get("trust_region_kl_max", 0.0)
    if "ref_kl_sum" in total:
        metrics["ref_kl"] = total["ref_kl_sum"] * per_token
    if "entropy_sum" in total:
        metrics["entropy"] = total["entropy_sum"] * per_token
    if "router_aux_loss_sum" in total:
        metrics["router_aux_loss"] = total["router_aux_loss_sum"] * per_token
    return metrics


def predicts_action(action_mask: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool: the positions whose logits score an action token (t - 1 for token t)."""
    return F.pad(action_mask[..., 1:], (0, 1)) > 0


def packing_layout(model: nn.Module) -> str:
    """The packed layout (molt.trainer.batch.LAYOUTS) the model's attention implementation runs best:
    one row for flash attention's variable-length kernels, else rows as wide as the longest
    experience (a block-diagonal mask costs the whole row's square)."""
    implementation = getattr(model.config, "_attn_implementation", None) or ""
    return "row" if implementation.startswith("flash") else "rows"


def choose_layout(actor: Actor, pad_token_id: int, compute_dtype: torch.dtype) -> str:
    """train.packing's layout for this model, after checking that it keeps packed sequences apart:
    score three short random sequences packed (two share a row) and padded (collective, a few
    positions). Hugging Face's sdpa, eager and flash attention implementations honour per-sequence
    position ids; one that does not would let a sequence attend to the one before it, so the run
    then pads, with a warning."""
    layout = packing_layout(actor.model)
    generator = torch.Generator().manual_seed(0)
    vocab_size = actor.model.config.get_text_config().vocab_size
    experiences = []
    for rollout_id, length in enumerate((7, 4, 3)):
        token_ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        experiences.append(Experience(token_ids=token_ids, action_mask=[0] + [1] * (length - 1),
                                      behavior_logprobs=[0.0] * length, policy_versions=[0] * length,
                                      reward=0.0, score=0.0, group_id=0, rollout_id=rollout_id))
    packed, padded = (build_micro_batches(experiences, max_tokens_per_micro_batch=64, pad_token_id=pad_token_id,
                                          layout=name, temperature=actor.temperature)[0] for name in (layout, "padded"))
    mask = padded.attention_mask.to(actor.device)
    gap = ((actor.score(packed) - actor.score(padded)).abs() * mask).max().item()
    tolerance = 1e-3 if compute_dtype.itemsize >= 4 else 5e-2  # bf16 kernels differ more; a leak differs by far more
    if gap <= tolerance:
        return layout
    logger.warning("train.packing: packed and padded log-probs differ by %.3g (> %.0e) under attention "
                   "implementation %r, which does not keep packed sequences apart; training pads instead",
                   gap, tolerance, getattr(actor.model.config, "_attn_implementation", "?"))
    return "padded"
