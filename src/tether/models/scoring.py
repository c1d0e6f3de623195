"""Rollouts: tokenize prompts, sample responses, score them with policy and reference.

This is the only math-adjacent module that talks to models. Everything it returns is a tensor
whose shape is written beside it; masks follow the glossary (``response_mask`` True = counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tether.core.divergences import Divergences, divergences_from_logits, exact_and_divergences
from tether.core.kl import exact_kl_from_logits
from tether.core.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
)
from tether.models.head import (
    HEAD_CHUNK_POSITIONS,
    head_logits,
    head_row_slices,
    position_ids_from_mask,
    tail_hidden,
    tail_logits,
)
from tether.models.policy import PolicyWithValue
from tether.models.sampling import Rollout, tokenize_prompts


def response_forward(
    model: nn.Module,
    rollout: Rollout,
    with_values: bool = False,
    head_chunk: int = HEAD_CHUNK_POSITIONS,
    share_prefix: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logits (B, R, V) predicting each response token, and values (B, R) if asked.

    Works for a :class:`PolicyWithValue` (also wrapped by ``accelerator.prepare``, e.g. in DDP,
    whose forward syncs gradients) and for a bare causal LM (the reference). Position ids
    start at 0 on each row's first real prompt token, so a row scores the same inside a padded
    batch as alone. ``head_chunk`` and ``share_prefix`` (:func:`tether.models.head.tail_hidden`) are
    a bare LM's settings; a policy uses its own.
    """
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask  # (B, L)
    position_ids = position_ids_from_mask(attention_mask)
    R = rollout.response_ids.shape[1]
    if isinstance(getattr(model, "module", model), PolicyWithValue):
        return model(input_ids, attention_mask, position_ids, n_keep=R, with_values=with_values)
    return tail_logits(
        model,
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        n_keep=R,
        chunk_positions=head_chunk,
        share_prefix=share_prefix,
    )[0], None


def response_hidden(
    model: nn.Module, rollout: Rollout, share_prefix: bool = False
) -> tuple[nn.Module, Tensor]:
    """The causal LM behind ``model`` and its last hidden states (B, R, d) at the response positions.

    ``share_prefix`` is a bare LM's setting (:func:`tether.models.head.tail_hidden`); a policy uses its own.
    """
    replay = None
    if isinstance(model, PolicyWithValue):
        model, share_prefix, replay = model.lm, model.scoring_share_prefix, model.frozen
    position_ids = position_ids_from_mask(rollout.attention_mask)
    return model, tail_hidden(
        model,
        rollout.input_ids,
        attention_mask=rollout.attention_mask,
        position_ids=position_ids,
        n_keep=rollout.response_ids.shape[1],
        share_prefix=share_prefix,
        replay=replay,
    )


@dataclass
class TokenStats:
    """Per-token quantities of one model on a rollout, all (B, R) float32."""

    logprobs: Tensor
    values: Tensor | None = None
    entropy: Tensor | None = None
    logits: Tensor | None = None
    """(B, R, V) kept only when asked (exact KL)."""
    hidden: Tensor | None = None
    """(B, R, d) the model's last hidden states at the response positions, kept only when asked
    (the reference's, for the update guard's later measures: the reference is frozen)."""
    top_ids: Tensor | None = None
    """(B, R, k) long: the model's k most likely next tokens at each position, most likely first,
    kept only when asked (``top_k``: the KL attribution, :mod:`tether.core.attribution`)."""
    top_logprobs: Tensor | None = None
    """(B, R, k) float32: their log-probabilities at the sampling temperature, nats."""
    sampler_kl: Tensor | None = None
    """The policy's only, where the rollout kept a low-precision sampler's logits
    (``Rollout.sampler_logits``): the exact KL(sampler || policy) at each position, (B, R) nats."""
    divergences: Divergences | None = None
    """The reference's only, when asked (``divergences_alpha``): the forward KL, JS and
    alpha-divergence of the policy and the reference at each position (each (B, R), nats)."""


def rollout_logprobs(
    model: nn.Module,
    rollout: Rollout,
    temperature: float,
    with_values: bool = False,
    with_entropy: bool = False,
    *,
    keep_logits: bool = False,
    head_chunk: int = HEAD_CHUNK_POSITIONS,
    share_prefix: bool = False,
) -> TokenStats:
    """log pi(y_t | x, y_<t) of the rollout's responses at the sampling temperature.

    The same call serves policy, old policy and reference, so temperature and precision agree.
    ``head_chunk``, ``share_prefix``: a bare LM's LM-head slice size and prefix sharing (pass
    the policy's when scoring its reference); a :class:`PolicyWithValue` uses its own.
    """
    logits, values = response_forward(
        model, rollout, with_values=with_values, head_chunk=head_chunk, share_prefix=share_prefix
    )
    return TokenStats(
        logprobs=logprobs_from_logits(logits, rollout.response_ids, temperature),
        values=values,
        entropy=entropy_from_logits(logits, temperature) if with_entropy else None,
        logits=logits if keep_logits else None,
    )


@torch.no_grad()
def policy_and_reference_logprobs(
    policy: PolicyWithValue,
    reference: nn.Module | None,
    rollout: Rollout,
    temperature: float,
    with_values: bool = False,
    *,
    exact_kl: bool = False,
    policy_logits: Tensor | None = None,
    kl_chunk_size: int = 1024,
    ref_hidden: Tensor | None = None,
    keep_ref_hidden: bool = False,
    top_k: int = 0,
    ref_logits: Tensor | None = None,
    keep_ref_logits: bool = False,
    divergences_alpha: float | None = None,
    with_sampler_kl: bool = False,
) -> tuple[TokenStats, TokenStats | None, Tensor | None]:
    """No-grad scoring of a rollout by the policy and the reference, one LM-head slice at a time.

    Each model runs its trunk once to the last hidden states (B, R, d); then, one
    :func:`tether.models.head.head_row_slices` slice at a time (``policy.head_chunk`` positions, at
    least one row), the LM head gives both models' logits for that slice only, and the
    log-probs, the policy's entropy and the exact per-token KL are taken from them before the
    next slice. No (B, R, V) logits are made here (``policy_logits``, when given, are the update's
    own, held by its graph anyway): the extra memory of the exact KL is
    O(max(head_chunk, R) * V), independent of B.

    The slices are those the update's forward uses (:func:`tether.models.head.apply_head`), so the
    numbers equal a full forward's bit for bit (tested): the first PPO ratio stays exactly 1 and
    the step-0 KL exactly 0.

    Args:
        policy: the policy (bare, not DDP-wrapped: this is no-grad scoring).
        reference: the frozen reference, or None (then no ref log-probs and no exact KL).
        rollout: B rows with R response positions.
        temperature: the sampling temperature (> 0).
        with_values: also the value head's estimates.
        exact_kl: also the exact full-vocabulary KL per token (needs a reference).
        policy_logits: (B, R, V) the policy's logits when already computed (the update's update_forward
            forward, detached): the policy's trunk is then not run again.
        kl_chunk_size: positions per float32 chunk inside :func:`tether.core.kl.exact_kl_from_logits`.
        ref_hidden: (B, R, d) the reference's last hidden states on this rollout, kept from an
            earlier call (``keep_ref_hidden``): its trunk is then not run again (frozen weights,
            the same rows: the same numbers up to the batching of the earlier call).
        keep_ref_hidden: return the reference's hidden states in its TokenStats (``hidden``).
        top_k: also each model's ``top_k`` most likely next tokens and their log-probabilities at
            each position (``top_ids``, ``top_logprobs``), from the same slices; 0 = not.
        ref_logits: (B, R, V) the reference's logits on this rollout, kept from an earlier call
            (``keep_ref_logits``): neither its trunk nor its LM head runs again.
        keep_ref_logits: return the reference's logits (B, R, V) in its TokenStats (``logits``):
            ``B * R * V`` floats the caller decided it can hold.
        divergences_alpha: with ``exact_kl``, also the forward KL, JS and the alpha-divergence of
            this order at each position, from the same slices (the reference's TokenStats'
            ``divergences``, :func:`tether.core.divergences.divergences_from_logits`); None = not.

    ``with_sampler_kl``, where the rollout kept its sampler's logits (``rollout.sampler_logits``: a
    bfloat16 sampler): also the exact KL(sampler || policy) at each position, from the same slices
    (the policy TokenStats' ``sampler_kl``; step 4's scoring asks, the guard's measures do not).

    Returns:
        (policy TokenStats with logprobs, entropy and values if asked; reference TokenStats with logprobs
        or None; exact KL (B, R) float32 nats or None). Unmasked.
    """
    B, R = rollout.response_ids.shape
    tokens = rollout.response_ids
    exact_kl = exact_kl and reference is not None
    policy_lm = hidden = values = None
    if policy_logits is None:
        policy_lm, hidden = response_hidden(policy, rollout)
        values = policy.values(hidden) if with_values else None
    ref_lm = None
    if reference is not None and ref_logits is not None:
        pass  # the reference's logits are given: no trunk, no head
    elif reference is not None and ref_hidden is not None:
        ref_lm = reference.lm if isinstance(reference, PolicyWithValue) else reference
    elif reference is not None:
        ref_lm, ref_hidden = response_hidden(reference, rollout, policy.scoring_share_prefix)
    device = tokens.device
    logprobs, entropy = torch.empty(B, R, device=device), torch.empty(B, R, device=device)
    ref_logprobs = torch.empty(B, R, device=device) if reference is not None else None
    exact = torch.empty(B, R, device=device) if exact_kl else None
    others = (
        [torch.empty(B, R, device=device) for _ in Divergences._fields]
        if exact_kl and divergences_alpha is not None
        else None
    )
    tops = {
        who: (
            torch.empty(B, R, top_k, dtype=torch.long, device=device),
            torch.empty(B, R, top_k, device=device),
        )
        for who in (("policy", "reference") if reference is not None else ("policy",))
        if top_k
    }
    kept_ref = None
    # (B, R', V) bfloat16, R' <= R (a row's decode may stop early), or None
    q = rollout.sampler_logits if with_sampler_kl else None
    sampler_kl = torch.zeros(B, R, device=device) if q is not None else None
    for rows in head_row_slices(B, R, policy.head_chunk):
        z = (
            policy_logits[rows] if policy_logits is not None else head_logits(policy_lm, hidden[rows])
        )  # (b, R, V)
        logprobs[rows] = logprobs_from_logits(z, tokens[rows], temperature)
        entropy[rows] = entropy_from_logits(z, temperature)
        if q is not None:  # KL(sampler || learner) where the sampler decoded (later slots: padding)
            n = q.shape[1]
            sampler_kl[rows, :n] = exact_kl_from_logits(q[rows].float(), z[:, :n], temperature, kl_chunk_size)
        if top_k:
            tops["policy"][0][rows], tops["policy"][1][rows] = top_logprobs(
                z, top_k, temperature, tokens=tokens[rows], logprobs=logprobs[rows]
            )
        if reference is not None:
            z_ref = ref_logits[rows] if ref_logits is not None else head_logits(ref_lm, ref_hidden[rows])
            if keep_ref_logits:
                if kept_ref is None:
                    kept_ref = z_ref.new_empty(B, R, z_ref.shape[-1])  # (B, R, V)
                kept_ref[rows] = z_ref
            ref_logprobs[rows] = logprobs_from_logits(z_ref, tokens[rows], temperature)
            if exact_kl and others is not None:  # one log-softmax of each side for all four
                exact[rows], parts = exact_and_divergences(
                    z, z_ref, temperature, divergences_alpha, kl_chunk_size
                )
            elif exact_kl:
                exact[rows] = exact_kl_from_logits(z, z_ref, temperature, kl_chunk_size)
            elif others is not None:
                parts = divergences_from_logits(z, z_ref, temperature, divergences_alpha, kl_chunk_size)
            if others is not None:
                for o, part in zip(others, parts):
                    o[rows] = part
            if top_k:
                tops["reference"][0][rows], tops["reference"][1][rows] = top_logprobs(
                    z_ref, top_k, temperature, tokens=tokens[rows], logprobs=ref_logprobs[rows]
                )
            del z_ref
        del z
    none = (None, None)
    ref = (
        TokenStats(
            ref_logprobs,
            logits=kept_ref,
            hidden=ref_hidden if keep_ref_hidden else None,
            divergences=Divergences(*others) if others is not None else None,
            **_tops(tops.get("reference", none)),
        )
        if reference is not None
        else None
    )
    own = TokenStats(logprobs, values, entropy, sampler_kl=sampler_kl, **_tops(tops.get("policy", none)))
    return own, ref, exact


def _tops(pair: tuple[Tensor | None, Tensor | None]) -> dict:
    return {"top_ids": pair[0], "top_logprobs": pair[1]}


def top_logprobs(
    logits: Tensor,
    k: int,
    temperature: float,
    *,
    tokens: Tensor | None = None,
    logprobs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely next tokens of ``logits`` (..., V) at ``temperature`` (> 0: dividing
    keeps the order), most likely first, with their log-probabilities (float32, nats):
    ``(ids (..., k) long, logprobs (..., k))``. Ties keep torch.topk's order.

    With the sampled ``tokens`` (...) and their ``logprobs`` (...) already taken from the same
    logits (:func:`tether.core.logprobs.logprobs_from_logits`), the normalizer is recovered from
    them, ``logsumexp = z[y] / T - logprob(y)``, instead of another pass over the vocabulary (the
    pass costs 0.021 s for 10 x 24 positions of SmolLM2's 49,152 ids here, the top-k 0.009 s); it
    agrees with a fresh logsumexp to float32 rounding (a few 1e-6 nats), which these displayed
    probabilities do not show.
    """
    values, ids = logits.topk(k, dim=-1)
    if tokens is not None and logprobs is not None:
        picked = logits.gather(-1, tokens[..., None])[..., 0].float() / temperature
        lse = picked - logprobs.float()
    else:
        lse = torch.logsumexp(logits.float() / temperature, dim=-1)
    return ids, values.float() / temperature - lse[..., None]


def rollout_from_responses(
    tokenizer,
    prompts: list[str],
    responses: list[Tensor],
    max_prompt_tokens: int = 64,
    device: torch.device | str = "cpu",
) -> Rollout:
    """A :class:`Rollout` of given response token ids (e.g. DPO's chosen or rejected), on ``device``.

    Args:
        prompts: B prompt strings.
        responses: B 1-D long tensors, each a response (ending with EOS if it ended there).
        device: where the rollout's tensors go (the scoring model's device).

    Returns:
        Rollout with responses right-padded with the pad token and ``response_mask`` True on
        each response's own tokens.
    """
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_tokens, device)
    R = max(1, max(len(r) for r in responses))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(responses), R), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(responses), R), dtype=torch.bool, device=device)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = True
    texts = tokenizer.batch_decode([r for r in responses], skip_special_tokens=True)
    return Rollout(
        list(prompts),
        prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=ids,
        response_mask=mask,
        responses=texts,
    )
