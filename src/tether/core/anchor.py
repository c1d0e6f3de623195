"""The text anchor's math: the exact forward KL to the reference on human text, and the ptx NLL.

The leash bounds the *reverse* KL ``KL(pi || pi_ref)`` on the policy's own samples; what the
capability probe measures, the policy's NLL on human text against the reference's, is close to
the *forward* KL ``KL(pi_ref || pi)`` on human-text prefixes (docs/kl.md, "The text anchor").
The anchor adds that forward KL to the loss, exactly over the vocabulary at every position of a
batch of fixed human text:

    FKL_t = sum_v pi_ref(v | x_<t) (log pi_ref(v | x_<t) - log pi(v | x_<t))       (nats)

and its gradient with respect to the policy's logits ``z_t`` is exactly ``pi(. | x_<t) - pi_ref(. |
x_<t)`` (the derivative of the cross-entropy ``-sum_v pi_ref log softmax(z)_v``; the entropy of
``pi_ref`` does not depend on ``z``). Its minimum, 0, is the reference itself at every position.

The classic alternative (InstructGPT's PPO-ptx, Ouyang et al. 2022, eq. 2) is the NLL of the text,
``-log pi(x_t | x_<t)``, gradient ``pi - onehot(x_t)``: its minimum is not the reference but the
text's own next token, so a ptx term pulls the policy toward the anchor corpus (fine-tuning on it),
past the reference, where the forward KL pulls it back to the reference only.

Torch only; the trainers call it through :mod:`tether.trainers.anchor`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

AnchorKind = Literal["forward_kl", "ptx"]
"""``anchor.kind``: the exact forward KL to the reference, or the text's NLL (PPO-ptx)."""


class _ForwardKL(torch.autograd.Function):
    """Per-position ``KL(softmax(ref) || softmax(z))`` with the gradient ``softmax(z) - softmax(ref)``,
    ``chunk`` positions at a time in both passes (saves only its inputs, no (N, V) intermediates)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ref_logprobs: Tensor, chunk: int) -> Tensor:
        N, _ = logits.shape
        out = torch.empty(N, dtype=torch.float32, device=logits.device)
        for s in range(0, N, chunk):
            lq = ref_logprobs[s : s + chunk].float()
            lp = torch.log_softmax(logits[s : s + chunk].float(), dim=-1)
            q = lq.exp()
            # q (lq - lp); where q == 0 the term is 0 even if lq is -inf (xlogy convention)
            out[s : s + chunk] = torch.where(q == 0, torch.zeros_like(q), q * (lq - lp)).sum(-1)
        ctx.save_for_backward(logits, ref_logprobs)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ref_logprobs = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            p = torch.softmax(logits[s : s + ctx.chunk].float(), dim=-1)
            q = ref_logprobs[s : s + ctx.chunk].float().exp()
            grad[s : s + ctx.chunk] = ((p - q) * grad_out[s : s + ctx.chunk, None]).to(logits.dtype)
        return grad, None, None


def forward_kl_from_logits(logits: Tensor, ref_logprobs: Tensor, chunk_size: int = 1024) -> Tensor:
    """Exact per-position forward KL ``KL(pi_ref || pi)`` over the vocabulary, with its exact gradient.

    ``FKL = sum_v q(v) (log q(v) - log p(v))``, ``p = softmax(logits)``, ``q = exp(ref_logprobs)``;
    ``d FKL / d logits = p - q`` (computed so, not through autograd's graph of a log-softmax:
    the backward recomputes ``p`` per chunk, so the extra memory is O(chunk_size * V)). Float32
    inside whatever the input dtype; where ``q(v) == 0`` the term is 0 (``xlogy``), a NaN or +inf
    logit gives NaN. Temperature 1: the models' own distributions on text they did not sample.

    Args:
        logits: (..., V) the policy's logits, with grad, any float dtype.
        ref_logprobs: (..., V) the reference's log-probabilities (a log-softmax), no grad.
        chunk_size: positions per chunk (> 0).

    Returns:
        (...) float32 per-position forward KL, nats, >= 0 up to rounding. Unmasked.

    Raises:
        ValueError: shape mismatch or chunk_size <= 0.
    """
    if logits.shape != ref_logprobs.shape:
        raise ValueError(f"logits {tuple(logits.shape)} != ref_logprobs {tuple(ref_logprobs.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    V = logits.shape[-1]
    flat = _ForwardKL.apply(logits.reshape(-1, V), ref_logprobs.detach().reshape(-1, V), chunk_size)
    return flat.view(logits.shape[:-1])


def text_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-position NLL ``-log softmax(logits)[target]`` (nats, float32), gradient ``p - onehot``.

    Args:
        logits: (B, T, V) with grad. targets: (B, T) long, the text's next tokens.

    Returns:
        (B, T) float32, unmasked.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class AnchorTerm(NamedTuple):
    """One anchor batch's numbers (token means over its ``mask``, this process's rows)."""

    loss: Tensor
    """scalar with grad: ``coef * mean_t FKL_t`` (forward_kl) or ``coef * mean_t NLL_t`` (ptx)."""
    forward_kl: Tensor
    """scalar, no grad: mean per-token forward KL to the reference, nats per token."""
    nll: Tensor
    """scalar, no grad: mean per-token NLL of the text under the policy, nats per token."""


def anchor_term(
    logits: Tensor,
    ref_logprobs: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    coef: float,
    kind: AnchorKind,
    chunk_size: int = 1024,
) -> AnchorTerm:
    """The anchor's loss on one batch of text: ``coef`` times the token mean of the forward KL or NLL.

    Token mean over ``mask`` (True = counts: a real next token, not padding); a batch with no
    counted token gives a loss of 0 (times the logits, so the graph still reaches them) and NaN
    statistics.

    Args:
        logits: (B, T, V) the policy's logits predicting ``targets``, with grad.
        ref_logprobs: (B, T, V) the reference's log-probabilities at the same positions.
        targets: (B, T) long, the text's tokens at those positions.
        mask: (B, T) bool, True where a position counts.
        coef: the anchor's weight (>= 0), ``anchor.coef``; loss units: nats per token times it.
        kind: ``"forward_kl"`` or ``"ptx"`` (:data:`AnchorKind`).
        chunk_size: positions per chunk of the forward KL.

    Raises:
        ValueError: an unknown kind, a negative coef, or shapes that disagree.
    """
    if kind not in ("forward_kl", "ptx"):
        raise ValueError(f"anchor.kind must be forward_kl or ptx, got {kind!r}")
    if coef < 0:
        raise ValueError(f"anchor.coef must be >= 0, got {coef}")
    if targets.shape != mask.shape or logits.shape[:-1] != mask.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, targets {tuple(targets.shape)}, mask {tuple(mask.shape)} disagree"
        )
    n = mask.sum()
    fkl = forward_kl_from_logits(logits, ref_logprobs, chunk_size) if kind == "forward_kl" else None
    nll = text_nll(logits, targets) if kind == "ptx" else None
    with torch.no_grad():
        fkl_value = (
            fkl if fkl is not None else forward_kl_from_logits(logits.detach(), ref_logprobs, chunk_size)
        )
        nll_value = nll if nll is not None else text_nll(logits.detach(), targets)
        stats = (
            torch.where(mask, fkl_value, 0.0).sum() / n,  # NaN for an empty batch (0 / 0)
            torch.where(mask, nll_value, 0.0).sum() / n,
        )
    term = fkl if fkl is not None else nll
    assert term is not None
    # a token mean; an empty batch: 0 (clamp the count to 1 only where the sum is 0 anyway)
    loss = coef * torch.where(mask, term, 0.0).sum() / n.clamp(min=1)
    return AnchorTerm(loss=loss, forward_kl=stats[0].detach(), nll=stats[1].detach())
