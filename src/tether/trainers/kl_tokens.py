"""Step 11's KL attribution (``kl.attribution``): where each step's exact KL went.

Every step, from the exact per-position KL step 4 computed (no extra forward), the ``kl/*``
metrics of :func:`tether.core.attribution.token_kl_summary` over every process's tokens. On a
jump of the KL reading (a rise past the previous step's by more than ``kl.tokens_jump``), on the
step that crosses ``kl.budget``, and every ``kl.tokens_every`` steps, a record for
``kl_tokens.jsonl``: the step's top positions by exact KL (the decoded context, the token, its
exact KL and k1, the policy's and the reference's top-5 next tokens with their probabilities, the
sampler's and the learner's log-probs), the KL by token id, which ids carried the rise from the
previous step, and each listed response's tokens with their KL (the report's heat map).

A token whose sampler and learner log-probs differ by more than :data:`MISALIGNED_NATS` is marked
``misaligned``: its KL may come from an alignment or precision fault between the sampler and the
learner, not from drift (``kl/misaligned_share`` is the share of the KL on such tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.attribution import (
    QUANTILE_TOKENS,
    kl_by_token_id,
    kl_parts,
    position_deciles,
    rise_by_token_id,
    summary_of,
)

MISALIGNED_NATS = 0.1
"""A token's sampler and learner log-probs further apart than this (nats) mark it misaligned. The
learner rescoring the sampler's own token in float32 differs by rounding, about 1e-5 nats; a
bf16 sampler by up to a few hundredths; a token scored at the wrong position (an off-by-one) or
under another template by nats."""

TOP_POSITIONS = 20
"""The positions a record lists (the issue's top 20), and the token ids."""

CONTEXT_TOKENS = 24
"""Tokens of context (prompt and response before the position) a record decodes."""


@dataclass(kw_only=True)
class KLAttribution:
    """The attribution of one run (a trainer holds it; its state is checkpointed).

    Attributes:
        tokenizer: decodes contexts and tokens for the records.
        special_ids: the special and template token ids
            (:func:`tether.models.sampling.special_token_ids`).
        jump: ``kl.tokens_jump``, a fraction of the previous step's reading.
        every: ``kl.tokens_every``, steps (0 = off).
        budget: ``kl.budget`` where a budget controller holds it (its crossing writes a record),
            else None.
    """

    tokenizer: object
    special_ids: list[int]
    jump: float = 0.5
    every: int = 0
    budget: float | None = None
    previous: float | None = None
    """The previous step's KL reading (checkpointed), None before the first step."""
    previous_by_id: dict[int, tuple[float, int]] = field(default_factory=dict)
    """The previous step's :func:`tether.core.attribution.kl_by_token_id` (checkpointed)."""

    def state_dict(self) -> dict:
        return {"previous": self.previous, "previous_by_id": dict(self.previous_by_id)}

    def load_state_dict(self, state: dict) -> None:
        self.previous = state.get("previous")
        self.previous_by_id = {
            int(k): (float(v[0]), int(v[1])) for k, v in state.get("previous_by_id", {}).items()
        }

    def reason(self, step: int, reading: float) -> str | None:
        """Why step ``step`` writes a record (``jump``, ``budget`` or ``every``), or None."""
        prev = self.previous
        if prev is not None and reading > max(prev, 0.0) * (1.0 + self.jump) and reading > prev:
            return "jump"  # from a reading of 0 (step 0's: the policy is the reference) any rise
        if self.budget is not None and prev is not None and prev <= self.budget < reading:
            return "budget"
        if self.every and step % self.every == 0:
            return "every"
        return None

    def step(
        self,
        step: int,
        *,
        reading: float | None,
        rollout,
        exact_kl: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor,
        top: dict[str, tuple[Tensor, Tensor]] | None,
    ) -> tuple[dict[str, float], dict | None]:
        """The step's ``kl/*`` metrics (every process the same) and its record for
        kl_tokens.jsonl, or None where none is due (:meth:`reason`).

        Args:
            step: the step.
            reading: the step's KL reading (the controller's, ``kl.target_unit``), or None.
            rollout: the step's samples (:class:`tether.models.sampling.Rollout`): its
                ``response_mask`` (B, R) bool, ``response_ids`` (B, R), ``prompt_ids`` and
                ``prompt_mask`` (B, P), ``sampler_logprobs`` (B, R) or None.
            exact_kl: (B, R) the exact per-position KL, nats.
            old_logprobs, ref_logprobs: (B, R) the learner's and the reference's log-probs of the
                sampled tokens, nats.
            top: the models' top-k next tokens (B, R, k) each, or None (no agreement, no top-5).
        """
        mask = rollout.response_mask.bool()
        ids = rollout.response_ids
        mis = None
        if rollout.sampler_logprobs is not None:
            diff = (rollout.sampler_logprobs.float() - old_logprobs.float()).abs()
            mis = torch.where(mask, diff > MISALIGNED_NATS, False)
        agree = None
        if top is not None and "reference" in top:
            agree = top["policy"][0][..., 0] == top["reference"][0][..., 0]
        special = torch.zeros_like(mask)
        if self.special_ids:
            special = torch.isin(ids, torch.tensor(self.special_ids, device=ids.device))
        kl = exact_kl[mask].to(torch.float64)  # (n,) this process's policy tokens
        parts = D.all_reduce_sum(
            kl_parts(
                kl,
                special=special[mask],
                decile=position_deciles(mask)[mask],
                agree=agree[mask] if agree is not None else None,
                misaligned=mis[mask] if mis is not None else None,
            )
        )
        n_total = int(parts[0])
        k = max(1, math.ceil(0.01 * n_total))
        ordered = kl.sort().values
        if n_total > QUANTILE_TOKENS and len(ordered):  # an evenly spaced sample of the sorted values
            take = max(1, math.ceil(len(ordered) * QUANTILE_TOKENS / n_total))
            ordered = ordered[torch.linspace(0, len(ordered) - 1, take, device=ordered.device).round().long()]
        gathered = D.gather_objects(
            (ordered.cpu(), kl.topk(min(k, len(kl))).values.cpu(), kl_by_token_id(kl, ids[mask]))
        )
        maximum = float(
            D.all_reduce_max(
                kl.max() if len(kl) else torch.tensor(-math.inf, dtype=torch.float64, device=kl.device)
            )
        )
        summary = summary_of(
            parts,
            top_values=torch.cat([g[1] for g in gathered]),
            quantile_values=torch.cat([g[0] for g in gathered]).sort().values,
            maximum=maximum,
            with_agree=agree is not None,
            with_misaligned=mis is not None,
        )
        metrics = {f"kl/{key}": v for key, v in summary.items()}
        by_id: dict[int, tuple[float, int]] = {}
        for _, _, part in gathered:  # every process's ids, summed
            for i, (v, c) in part.items():
                a, b = by_id.get(i, (0.0, 0))
                by_id[i] = (a + v, b + c)
        why = self.reason(step, reading) if reading is not None else None
        record = None
        if why is not None:
            record = self.record(
                step,
                why=why,
                reading=reading,
                rollout=rollout,
                exact_kl=exact_kl,
                old_logprobs=old_logprobs,
                ref_logprobs=ref_logprobs,
                top=top,
                mis=mis,
                by_id=by_id,
            )
        if reading is not None:
            self.previous = reading
        self.previous_by_id = by_id
        return metrics, record

    def record(
        self,
        step: int,
        *,
        why: str,
        reading: float,
        rollout,
        exact_kl,
        old_logprobs,
        ref_logprobs,
        top,
        mis,
        by_id,
    ) -> dict:
        """The step's kl_tokens.jsonl record (module docstring); every process gets the same."""
        mask = rollout.response_mask.bool()
        B, R = mask.shape
        flat = torch.where(mask, exact_kl.float(), float("-inf")).flatten()
        k = min(TOP_POSITIONS, int(mask.sum()))
        values, where = flat.topk(k) if k else (flat[:0], flat[:0].long())
        rank_rows = B * D.rank()  # the batch's global row: every process holds B rows
        mine = []
        for v, w in zip(values.tolist(), where.tolist()):
            b, t = divmod(w, R)
            mine.append(
                self.position(
                    b,
                    t,
                    v,
                    rank_rows=rank_rows,
                    rollout=rollout,
                    old_logprobs=old_logprobs,
                    ref_logprobs=ref_logprobs,
                    top=top,
                    mis=mis,
                )
            )
        heat = {}
        for entry in mine:  # each listed response's tokens with their KL, for the report's heat map
            b = entry["row"] - rank_rows
            if entry["row"] not in heat:
                # up to the response's last policy token: the slots after it are padding (an
                # environment's tokens before it stay, unshaded)
                end = int(mask[b].nonzero().max()) + 1 if bool(mask[b].any()) else 0
                heat[entry["row"]] = [
                    [self.decode([int(i)]), float(x) if m else None]
                    for i, x, m in zip(
                        rollout.response_ids[b, :end].tolist(),
                        exact_kl[b, :end].tolist(),
                        mask[b, :end].tolist(),
                    )
                ]
        gathered = D.gather_objects((mine, heat))
        positions = sorted((e for part, _ in gathered for e in part), key=lambda e: -e["kl"])[:TOP_POSITIONS]
        heats = {r: h for _, part in gathered for r, h in part.items()}
        total = sum(v[0] for v in by_id.values())
        listed = sorted(by_id.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_POSITIONS]
        out = {
            "step": step,
            "reason": why,
            "kl": reading,
            "previous_kl": self.previous,
            "kl_sum": total,
            "top_share": (sum(e["kl"] for e in positions) / total) if total > 0 else None,
            "positions": positions,
            "by_token_id": [
                {
                    "id": i,
                    "token": self.decode([i]),
                    "kl": s,
                    "count": n,
                    "share": s / total if total > 0 else None,
                }
                for i, (s, n) in listed
            ],
            "responses": {str(r): heats[r] for r in sorted({e["row"] for e in positions})},
        }
        if self.previous_by_id:
            rises, rise, explained = rise_by_token_id(by_id, self.previous_by_id, top=TOP_POSITIONS)
            out["rise"] = {
                "kl_sum": rise,
                "explained": None if math.isnan(explained) else explained,
                "by_token_id": [{"id": i, "token": self.decode([i]), "rise": r} for i, r in rises],
            }
        return out

    def position(self, b, t, value, *, rank_rows, rollout, old_logprobs, ref_logprobs, top, mis) -> dict:
        """One listed position: row ``b``, response position ``t``, its exact KL ``value``."""
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b].bool()].tolist()
        context = (prompt + rollout.response_ids[b, :t].tolist())[-CONTEXT_TOKENS:]
        token = int(rollout.response_ids[b, t])
        entry = {
            "row": rank_rows + b,
            "position": t,
            "context": self.decode(context),
            "token": self.decode([token]),
            "token_id": token,
            "kl": value,
            "k1": float(old_logprobs[b, t] - ref_logprobs[b, t]),
            "logprob": float(old_logprobs[b, t]),
            "ref_logprob": float(ref_logprobs[b, t]),
        }
        if rollout.sampler_logprobs is not None:
            entry["sampler_logprob"] = float(rollout.sampler_logprobs[b, t])
            entry["misaligned"] = bool(mis[b, t]) if mis is not None else False
        for who in ("policy", "reference"):
            if top is not None and who in top:
                ids, lps = top[who]
                entry[f"{who}_top"] = [
                    [self.decode([int(i)]), math.exp(float(lp))]
                    for i, lp in zip(ids[b, t].tolist(), lps[b, t].tolist())
                ]
        return entry

    def decode(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens kept (a template's delimiters are what to see)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
