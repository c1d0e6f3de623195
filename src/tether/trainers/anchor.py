"""The text anchor in the update: one batch of human text per optimizer step (``anchor.*``).

:class:`TextAnchor` holds the tokenized texts, cuts them into fixed batches (batch ``k`` is
always the same rows, so the reference's share of the work is done once per batch), and for each
optimizer step returns the anchor's term on the next batch (:func:`tether.core.anchor.anchor_term`):
the policy's logits with grad against the reference's log-probabilities, which come from the
reference's last hidden states cached per batch (the text is fixed, the reference frozen; only its
LM head runs again, float32 exact). Texts of like length share a batch (the batches, in a fixed
shuffled order, are cut from the texts sorted by length) and the LM heads run on the text's
positions only, not on padding: the same terms at about half the cost of batches of any lengths
padded (:data:`BATCH_ORDER_SEED`). :func:`tether.trainers.update.minibatch_update` adds it to the
step's loss once, before the step's micro-batches (:data:`tether.trainers.update.StepTerm`).

**A budget** (``anchor.budget``): the weight is moved every optimizer step by a
:class:`tether.core.controllers.BudgetKLController` that reads the forward KL of the very batch
it weighs, before the backward (the token mean over every process, so that every process takes
the same weight), in units of the budget (the controller's budget is 1 and it reads
``forward_kl / anchor.budget``: its gains are per unit of relative error, the same for any
budget). The weight thus acts on the update whose KL it read, with no step of lag; it is
checkpointed with the anchor's position and carried across a resume, whose changed gains or
budget are printed.

Several processes: each takes an equal share of every batch's rows (``anchor.batch_size`` is a
multiple of the world size), its term a token mean over its rows weighed by its share of the
batch's tokens over every process (:func:`tether.core.distributed.token_shares`), so the terms
sum to the token mean of the whole batch and DDP's average makes it the gradient of that mean.
Under FSDP every process runs the same forwards in the same order (the reference's trunk is
cached for a batch by all processes or by none), as FSDP's collectives need.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.anchor import AnchorKind, anchor_term
from tether.core.controllers import BudgetKLController
from tether.models.head import apply_head, left_padded, position_ids_from_mask, tail_hidden
from tether.models.policy import PolicyWithValue
from tether.models.sharding import is_sharded, root_gathered
from tether.run.setup import model_context
from tether.trainers.update import MicroLoss

log = logging.getLogger(__name__)

REF_HIDDEN_BYTES = 256 << 20
"""Most bytes of the reference's kept hidden states per process (256 MiB): past it a batch's are
computed again each time it comes round (the builtin corpus at the defaults takes about 240 MB
once every batch has been used)."""


BATCH_ORDER_SEED = 0
"""Seed of the fixed shuffle of the anchor's batches (``random.Random(BATCH_ORDER_SEED)``): cut
from the texts sorted by length, taken in this order, so that the run does not go from the
shortest texts to the longest."""


@dataclass(frozen=True, kw_only=True)
class AnchorSettings:
    """``anchor.*`` as the update uses them."""

    coef: float
    kind: AnchorKind
    batch_size: int
    """Texts per optimizer step over every process."""
    max_tokens: int
    chunk_size: int = 1024
    """Positions per chunk of the forward KL (``kl.exact_chunk_size``)."""
    budget: float | None = None
    """``anchor.budget``: the forward KL (nats per token) the weight holds the text to, or None
    for the fixed weight ``coef``."""
    budget_eta: float = 1.0
    """``anchor.budget_eta``: the dual step, weight per unit of relative error."""
    budget_kp: float = 4.0
    """``anchor.budget_kp``: the proportional gain, weight per unit of relative error."""


@dataclass
class TextBatch:
    """One anchor batch, this process's rows, left-padded."""

    input_ids: Tensor
    """(B, L - 1) long: each text but its last token."""
    attention_mask: Tensor
    """(B, L - 1) long, 0 on padding."""
    targets: Tensor
    """(B, L - 1) long: the next token at each position."""
    mask: Tensor
    """(B, L - 1) bool: True where a position and its next token are text (not padding)."""


def tokenize_texts(tokenizer, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each text's ids (``tokenizer(text)``, special tokens as the tokenizer adds them), its first
    ``max_tokens``; texts of fewer than 2 tokens are left out (nothing to predict)."""
    ids = [tokenizer(t).input_ids[:max_tokens] for t in texts]
    return [i for i in ids if len(i) >= 2]


def text_batch(rows: list[list[int]], pad_id: int, device) -> TextBatch:
    """Rows of token ids, left-padded to one length (:class:`TextBatch`)."""
    ids, attn = left_padded(rows, pad_id, device)
    return TextBatch(
        input_ids=ids[:, :-1],
        attention_mask=attn[:, :-1],
        targets=ids[:, 1:],
        mask=attn[:, :-1].bool(),  # left padding: a real position's next token is real too
    )


class TextAnchor:
    """The anchor's term per optimizer step (see the module's docstring).

    Args:
        policy: the run's policy (its LM runs with grad; its frozen blocks' replay is used).
        reference: the frozen reference (an LM, or the LoRA base with adapters off).
        texts: the human texts. tokenizer: the policy's. settings: :class:`AnchorSettings`.

    Raises:
        ValueError: fewer usable texts (2 tokens or more) than one batch.
    """

    def __init__(
        self, *, policy: PolicyWithValue, reference, texts: list[str], tokenizer, settings: AnchorSettings
    ):
        self.policy, self.reference, self.settings = policy, reference, settings
        context = model_context(policy.lm.config)
        self.max_tokens = min(settings.max_tokens, context) if context else settings.max_tokens
        """``anchor.max_tokens``, at most the model's positions (a longer text is cut there)."""
        if self.max_tokens < settings.max_tokens:
            log.warning(
                "tether: anchor.max_tokens=%d is more than the model's %d positions; texts are cut at %d",
                settings.max_tokens,
                context,
                self.max_tokens,
            )
        rows = tokenize_texts(tokenizer, texts, self.max_tokens)
        n_batches = len(rows) // settings.batch_size
        if n_batches == 0:
            raise ValueError(
                f"anchor.texts: {len(rows)} texts of 2 tokens or more, fewer than anchor.batch_size="
                f"{settings.batch_size}; give more text or a smaller batch"
            )
        self.n_batches = n_batches
        kept = sorted(rows[: n_batches * settings.batch_size], key=len)  # the remainder is left out
        bs = settings.batch_size
        order = list(range(n_batches))
        random.Random(BATCH_ORDER_SEED).shuffle(order)
        self.rows = [r for k in order for r in kept[k * bs : (k + 1) * bs]]
        """The texts' ids, batch ``k`` = ``rows[k * batch_size : (k + 1) * batch_size]``: texts of
        like length together, the batches in a fixed shuffled order."""
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.position = 0
        """Optimizer steps taken with the anchor; the next batch: ``position % n_batches`` (checkpointed)."""
        self.ref_hidden: dict[int, Tensor] = {}
        """The reference's last hidden states (B, L - 1, d) of this process's rows of each batch used."""
        self.controller = (
            None
            if settings.budget is None
            else BudgetKLController(
                kl_coef=settings.coef, budget=1.0, eta=settings.budget_eta, kp=settings.budget_kp
            )
        )
        """The weight's controller under ``anchor.budget`` (it reads ``forward_kl / budget``), or None."""

    @property
    def coef(self) -> float:
        """The weight the next term takes: ``anchor.coef``, or the controller's last one."""
        return self.settings.coef if self.controller is None else self.controller.kl_coef

    def batch(self, k: int) -> TextBatch:
        """This process's rows of batch ``k`` (:func:`tether.core.distributed.shard`)."""
        bs = self.settings.batch_size
        rows = self.rows[k * bs : (k + 1) * bs]
        mine = D.shard(len(rows))
        device = next(self.policy.parameters()).device
        return text_batch(rows[mine], self.pad_id, device)

    def reference_logprobs(self, k: int, b: TextBatch) -> Tensor:
        """(1, N, V) float32 log-probabilities of the reference at batch ``k``'s N text positions
        (``b.mask``, row-major): its trunk once per batch (cached hidden states), its LM head
        each time, on the text's positions (under FSDP on every position, as the policy's root
        forward projects them, then the text's taken)."""
        sharded = is_sharded(self.policy)
        with torch.no_grad(), root_gathered(self.reference):  # FSDP: the root unit's weights gathered
            hidden = self.ref_hidden.get(k)
            if hidden is None:
                hidden = tail_hidden(
                    self.reference,
                    b.input_ids,
                    attention_mask=b.attention_mask,
                    position_ids=position_ids_from_mask(b.attention_mask),
                    n_keep=b.input_ids.shape[1],
                )
                hidden = hidden if sharded else hidden[b.mask].unsqueeze(0)
                held = sum(h.numel() * h.element_size() for h in self.ref_hidden.values())
                fits = torch.tensor(float(held + hidden.numel() * hidden.element_size() <= REF_HIDDEN_BYTES))
                # every process keeps batch k's or none does: under FSDP the reference's trunk is
                # a collective, run by all processes together or by none
                if D.all_reduce_min(fits.to(hidden.device)).item() == 1.0:
                    self.ref_hidden[k] = hidden
            # the policy's head slices (apply_head): at equal weights the logits agree bit for bit
            logits = apply_head(self.reference, hidden, self.policy.head_chunk)
            logits = logits[b.mask].unsqueeze(0) if sharded else logits
            return torch.log_softmax(logits.float(), dim=-1)

    def policy_logits(self, k: int, b: TextBatch) -> Tensor:
        """(1, N, V) the policy's logits at batch ``k``'s text positions, with grad: the trunk
        (the frozen blocks' output kept across steps under the key ``("anchor", k)``), then the
        head on the text's positions, (1, N, d) as the reference's: the same kernel on the same
        shape, so at equal weights the two agree bit for bit (the step-0 term is 0). Under FSDP
        the update's forwards go through the root's forward (:mod:`tether.models.sharding`),
        which projects every position; the text's are taken after."""
        policy, mask = self.policy, b.mask
        pos = position_ids_from_mask(b.attention_mask)
        if is_sharded(policy):
            logits, _ = policy(b.input_ids, b.attention_mask, pos, b.input_ids.shape[1], with_values=False)
            return logits[mask].unsqueeze(0)
        hidden = tail_hidden(
            policy.lm,
            b.input_ids,
            attention_mask=b.attention_mask,
            position_ids=pos,
            n_keep=b.input_ids.shape[1],
            replay=policy.frozen,
            replay_key=("anchor", k),  # the same rows every time batch k comes round
        )
        return apply_head(policy.lm, hidden[mask].unsqueeze(0), policy.head_chunk)

    def term(self) -> tuple[MicroLoss, Tensor]:
        """The next batch's term: ``(MicroLoss, share)``, the loss a token mean over this process's
        rows times the weight (stats ``anchor/forward_kl``, ``anchor/nll``, nats per token, and
        ``anchor/coef``) and this process's share of the batch's tokens over every process (1 in
        one process). Under ``anchor.budget`` the weight is the controller's after it read this
        batch's forward KL (every process's tokens). Advances :attr:`position`.

        Raises:
            FloatingPointError: under a budget, a forward KL that is not finite (the weight would
                be NaN on every process; the step is not taken).
        """
        k = self.position % self.n_batches
        self.position += 1
        b = self.batch(k)
        ref_logprobs = self.reference_logprobs(k, b)
        logits = self.policy_logits(k, b)
        targets = b.targets[b.mask].unsqueeze(0)
        s = self.settings
        out = anchor_term(
            logits,
            ref_logprobs,
            targets,
            torch.ones_like(targets, dtype=torch.bool),
            coef=1.0 if self.controller is not None else s.coef,
            kind=s.kind,
            chunk_size=s.chunk_size,
        )
        share = D.token_shares([b.mask])[0]
        loss = out.loss
        if self.controller is not None:
            assert s.budget is not None
            # the whole batch's token mean: share 0 (no rows here) weighs this process's NaN by 0
            mine = torch.where(share > 0, out.forward_kl * share, 0.0).to(torch.float64).cpu()
            forward_kl = float(D.all_reduce_sum(mine))  # the same number on every process
            if not math.isfinite(forward_kl):
                raise FloatingPointError(
                    f"anchor/forward_kl is {forward_kl} on batch {k} of anchor.texts, so anchor.budget's "
                    "weight cannot follow it: the policy's logits on the text overflowed; lower optim.lr"
                )
            loss = self.controller.update(forward_kl / s.budget, n_steps=1) * loss
        stats = {"anchor/forward_kl": out.forward_kl, "anchor/nll": out.nll, "anchor/coef": self.coef}
        return MicroLoss(loss, stats), share

    def state_dict(self) -> dict:
        """The position, and under a budget the controller's state (its weight and dual) and the
        budget it held (``anchor.budget``)."""
        state: dict = {"position": self.position}
        if self.controller is not None:
            state["controller"] = self.controller.state_dict()
            state["budget"] = self.settings.budget
            state["coef"] = self.settings.coef
        return state

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore :meth:`state_dict`; returns what a resume changed, to be printed: the budget
        (the dual carries on: a weight, whatever the budget it held), its gains, or a budget newly
        on (the dual starting at ``anchor.coef``) or off (the fixed ``anchor.coef`` from here).

        Raises:
            ValueError: a controller state no tether wrote (from the controller).
        """
        self.position = int(state["position"])
        saved = state.get("controller")
        if self.controller is None:
            return ["anchor.budget off: the fixed anchor.coef from here"] if saved is not None else []
        if saved is None:
            return [f"anchor.budget newly on: its dual starts at anchor.coef={self.settings.coef:g}"]
        changes = []
        if state.get("budget") not in (None, self.settings.budget):
            changes.append(f"anchor.budget {state['budget']:g} -> {self.settings.budget:g} nats per token")
        if state.get("coef") not in (None, self.settings.coef):
            changes.append(
                f"anchor.coef {state['coef']:g} -> {self.settings.coef:g}, which under anchor.budget is only "
                "where a new dual starts: the checkpoint's dual carries on"
            )
        names = {"eta": "anchor.budget_eta", "kp": "anchor.budget_kp"}
        return changes + self.controller.load_state_dict(saved, names=names, whose="anchor.budget's")


def text_anchor(run) -> TextAnchor | None:
    """The run's :class:`TextAnchor` (``anchor.*``, the texts :func:`tether.run.setup.load_anchor_texts`
    loaded), or None when the anchor is off (``anchor.coef`` 0 and no ``anchor.budget``)."""
    a = run.config.anchor
    if not a.on or run.anchor_texts is None:
        return None
    return TextAnchor(
        policy=run.policy,
        reference=run.reference,
        texts=run.anchor_texts,
        tokenizer=run.tokenizer,
        settings=AnchorSettings(
            coef=a.coef,
            kind=a.kind,
            batch_size=a.batch_size,
            max_tokens=a.max_tokens,
            chunk_size=run.config.kl.exact_chunk_size,
            budget=a.budget,
            budget_eta=a.budget_eta,
            budget_kp=a.budget_kp,
        ),
    )


def restore_anchor(anchor: TextAnchor | None, saved: dict | None) -> None:
    """Carry a checkpoint's anchor on (:meth:`TextAnchor.load_state_dict`) and print what the
    resume changed, with the weight it goes on from (a budget's dual: the next weight is that
    plus the proportional term on the next batch's forward KL). The anchor newly on (no
    ``saved``) starts at batch 0; newly off (no ``anchor``): said."""
    if anchor is None or saved is None:
        if anchor is None and saved is not None:
            log.warning("tether: resuming with the text anchor off (anchor.coef=0, no anchor.budget)")
        return
    changes = anchor.load_state_dict(saved)
    if changes:
        going_on = (
            f"the fixed weight {anchor.coef:g}"
            if anchor.controller is None
            else f"the budget's dual {anchor.controller.dual:g} (last weight {anchor.coef:g})"
        )
        log.warning("tether: resuming with %s; the anchor goes on from %s", "; ".join(changes), going_on)
