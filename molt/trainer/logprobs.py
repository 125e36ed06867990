"""Token log-probs and entropy straight from the LM head, in sequence chunks.

The plain path materialises `hidden @ weight.T` as a [tokens, vocab] tensor, upcasts it, divides
it by the temperature and keeps a softmax for backward: at 16K tokens x 152K vocab one float32
copy of the logits is ~10 GB, and autograd keeps several. Here the LM head and the loss head are
one autograd function that walks the tokens `chunk_tokens` rows at a time, keeps only [tokens]
results (log-probs, logsumexp, entropy) and recomputes each chunk's logits in backward, so no
tensor larger than [chunk_tokens, vocab] is ever alive besides [vocab, hidden_size] ones (the same
idea as the fused linear + cross-entropy kernels in Liger-Kernel and Apple's Cut Cross-Entropy, in
plain PyTorch ops). Under bf16 compute the logits are still float32 products (`logits_matmul`), as
the importance ratios against the engine's log-probs need.
"""

import math

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable


def compute_chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float | Tensor,
                             chunk_tokens: int, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """[tokens] log softmax(z)[target] and, if `with_entropy`, [tokens] entropy of softmax(z), where
    z = (hidden @ weight.T) / temperature, the product itself in at least float32 (float64 stays
    float64; bf16/fp16 inputs are multiplied with a float32 output, never rounded to 16 bits first:
    `logits_matmul`).

    Why: whole logits do not fit; at 16K tokens x 152K vocab one float32 copy is ~10 GB and
    autograd keeps several. Peak extra memory here is a few [chunk_tokens, vocab] tensors in that
    dtype (logits, probabilities, their gradient) plus a [vocab, hidden_size] gradient accumulator
    for `weight`, and off CUDA for 16-bit inputs one float32 copy of `weight`. Backward recomputes
    each chunk's logits the forward's way: one more `hidden @ weight.T` of compute.

    Args:
        hidden: [tokens, hidden_size] final hidden states (any float dtype).
        weight: [vocab, hidden_size] LM head weight, same dtype as `hidden`.
        targets: [tokens] long, the token each position predicts.
        temperature: the sampling temperature the logits are divided by: one for every row, or a
            [tokens] tensor with each row's own (each target sampled at its own temperature); all
            > 0 and finite. Not differentiated.
        chunk_tokens: rows of [chunk_tokens, vocab] logits computed at a time (> 0).
        with_entropy: also return the entropy (and take its gradient in backward).
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_tokens)
    return _ChunkedLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens, with_entropy)


def check_temperature(temperature: float | Tensor) -> None:
    """Raises unless every temperature is positive and finite (a tensor costs one device sync)."""
    if not isinstance(temperature, Tensor):
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        return
    if not temperature.is_floating_point():
        raise ValueError(f"temperature tensor must be floating point, got {temperature.dtype}")
    bad = ~(torch.isfinite(temperature) & (temperature > 0))
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"temperatures must be positive and finite, got {temperature[index].item()} at index "
                         f"{list(index)} ({int(bad.sum())} of {temperature.numel()} bad)")


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float | Tensor,
                  chunk_tokens: int) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [tokens, hidden_size] and weight [vocab, hidden_size], "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [tokens] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if isinstance(temperature, Tensor) and temperature.shape != targets.shape:
        raise ValueError(f"a temperature tensor must be [tokens] = {tuple(targets.shape)}, one per target, "
                         f"got {tuple(temperature.shape)}")
    check_temperature(temperature)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}; "
                         f"cast hidden to the LM head's dtype first")


def _chunk_temperature(temperature: float | Tensor, rows: slice, dtype: torch.dtype) -> float | Tensor:
    """What one chunk's [chunk, vocab] logits divide by: the scalar, or [chunk, 1] of the rows' own."""
    return temperature if not isinstance(temperature, Tensor) else temperature[rows].to(dtype).unsqueeze(-1)


def logits_matmul(device_type: str, dtype: torch.dtype) -> str:
    """How a chunk's logits, at least float32, come from `dtype` hidden states and LM head weight:
    - "native": float32 or float64 inputs, `hidden @ weight.T` in their own dtype;
    - "out_dtype": float16/bfloat16 on CUDA, `torch.mm(..., out_dtype=torch.float32)`: cuBLAS
      accumulates in float32 and writes float32, with no float32 copy of the weight;
    - "upcast": float16/bfloat16 elsewhere, both operands upcast to float32 (the weight once per
      forward and once per backward: one float32 [vocab, hidden_size] copy alive while they run).
    Never a 16-bit product upcast after: rounding logits of size ~30 to bf16 moves them by up to
    0.06, straight into every log-prob and importance ratio."""
    if dtype not in (torch.float16, torch.bfloat16):
        return "native"
    # torch/_torch_docs.py, torch.mm(input, mat2, out_dtype): "Supported only on CUDA and for
    # torch.float32 given torch.float16/torch.bfloat16 input dtypes" (aten::mm.dtype has no CPU kernel).
    return "out_dtype" if device_type == "cuda" else "upcast"


def _scoring_weight(weight: Tensor, method: str) -> Tensor:
    """The LM head weight as the chunks' matmul takes it (`logits_matmul`)."""
    return weight.float() if method == "upcast" else weight


def _chunk_logits(hidden: Tensor, weight: Tensor, method: str) -> Tensor:
    """[chunk, vocab] logits in at least float32; `weight` from `_scoring_weight`. Forward and
    backward both call it, so the logits backward recomputes are the forward's exactly."""
    if method == "out_dtype":
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    if method == "upcast":
        return hidden.float() @ weight.T
    return hidden @ weight.T


def _chunk_logprobs(hidden: Tensor, weight: Tensor, method: str, logsumexp: Tensor | None,
                    temperature: float | Tensor) -> tuple[Tensor, Tensor]:
    """One chunk's [chunk, vocab] log-probs and [chunk] logsumexp; `logsumexp` is computed when
    None (forward) and reused when given (backward). `temperature`: a scalar or [chunk, 1]."""
    # The matmul's output is fresh, so the temperature and the normaliser are applied in place.
    logits = _chunk_logits(hidden, weight, method)  # [chunk, vocab]
    logits.div_(temperature)
    if logsumexp is None:
        logsumexp = torch.logsumexp(logits, dim=-1)  # [chunk]
    return logits.sub_(logsumexp.unsqueeze(-1)), logsumexp


class _ChunkedLogprobs(torch.autograd.Function):
    """See `compute_chunked_logprobs`. Saves hidden, weight, targets, the [tokens] logsumexp and
    entropy, and a temperature tensor if given; never logits."""

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float | Tensor,
                chunk_tokens: int, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        num_tokens = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        method = logits_matmul(hidden.device.type, hidden.dtype)
        scoring_weight = _scoring_weight(weight, method)
        logprobs = hidden.new_empty(num_tokens, dtype=dtype)  # [tokens]
        logsumexp = hidden.new_empty(num_tokens, dtype=dtype)  # [tokens]
        entropy = hidden.new_empty(num_tokens, dtype=dtype) if with_entropy else None  # [tokens]
        for start in range(0, num_tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk_logprobs, logsumexp[rows] = _chunk_logprobs(hidden[rows], scoring_weight, method, None,
                                                              _chunk_temperature(temperature, rows, dtype))
            logprobs[rows] = chunk_logprobs.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[rows] = -(chunk_logprobs.exp() * chunk_logprobs).sum(-1)
        per_row = isinstance(temperature, Tensor)
        ctx.save_for_backward(hidden, weight, targets, logsumexp, entropy, temperature if per_row else None)
        ctx.temperature, ctx.chunk_tokens = None if per_row else temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # a None grad means that output did not reach the loss
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprobs: Tensor | None,
                 grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, logsumexp, entropy, temperatures = ctx.saved_tensors
        temperature = ctx.temperature if temperatures is None else temperatures
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None
        # Summed over every chunk, so kept wide and rounded to weight's dtype once at the end.
        grad_weight = weight.new_zeros(weight.shape, dtype=logsumexp.dtype) if need_weight else None
        method = logits_matmul(hidden.device.type, hidden.dtype)
        scoring_weight = _scoring_weight(weight, method)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            chunk_temperature = _chunk_temperature(temperature, rows, logsumexp.dtype)
            logprobs, _ = _chunk_logprobs(hidden[rows], scoring_weight, method, logsumexp[rows], chunk_temperature)
            grad_logits = _chunk_grad_logits(logprobs, targets[rows], _rows(entropy, rows),
                                             _rows(grad_logprobs, rows), _rows(grad_entropy, rows))
            grad_logits.div_(chunk_temperature)  # z = logits / temperature
            if need_hidden:
                grad_hidden[rows] = grad_logits.to(hidden.dtype) @ weight  # [chunk, hidden_size]
            if need_weight:
                grad_weight.addmm_(grad_logits.T, hidden[rows].to(grad_weight.dtype))  # [vocab, hidden_size]
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def _rows(tensor: Tensor | None, rows: slice) -> Tensor | None:
    return None if tensor is None else tensor[rows]


def _chunk_grad_logits(logprobs: Tensor, targets: Tensor, entropy: Tensor | None,
                       grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> Tensor:
    """[chunk, vocab] d(loss)/dz from one chunk's [chunk, vocab] log-probs, built in place over them.

    With p = softmax(z): d log p_t / dz_j = [j = t] - p_j and dH/dz_j = -p_j (log p_j + H), so
    dz_j = -p_j (g_logprob + g_entropy (log p_j + H)) + g_logprob [j = t].
    """
    probs = logprobs.exp()  # [chunk, vocab]
    grad = logprobs  # the same buffer: from here on it holds the gradient, starting from log p
    if grad_entropy is not None:
        grad.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
        if grad_logprobs is not None:
            grad.add_(grad_logprobs.unsqueeze(-1))
    elif grad_logprobs is not None:
        grad.copy_(grad_logprobs.unsqueeze(-1).expand_as(grad))
    else:
        grad.zero_()
    grad.mul_(probs).neg_()
    if grad_logprobs is not None:
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
    return grad
