"""DPO: offline preference pairs, beta as the implicit KL leash (Rafailov et al. 2023).

Pairs come from a JSONL file (``prompt``, ``chosen``, ``rejected``, the TRL convention) or, by
default as in the DPO paper's sentiment task, are sampled: for each training prompt, draw
``dpo.candidates`` completions from the reference, score them with the run's scorer and pair the
best against the worst. Each step:

1. take the next ``rollout.batch_size`` pairs;
2. epochs of minibatches (:func:`tether.trainers.update.minibatch_update`): policy and reference
   sequence log-probs of chosen and rejected, the DPO loss
   (:func:`tether.trainers.steps.dpo_pair_loss`), update;
3. sample the policy on held-out prompts and measure its real KL(pi || pi_ref) and score, so DPO
   runs land on the same reward-against-KL axes as PPO, GRPO and RLOO;
4. metrics.

With several processes every process builds the same pairs; each takes a contiguous
``1 / world`` of every minibatch and of the held-out probe prompts, and the metrics are
reduced over processes (docs/distributed.md).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.kl import estimate_kl
from tether.core.losses import DPOLoss, dpo_loss
from tether.core.masked import masked_sum
from tether.core.shaping import shape_rewards
from tether.data.prompts import PromptSampler, explicit_pair, is_heldout, load_rows, prompt_key
from tether.judges.contract import ScorerFailed, ScorerStopped, score_rollout, trainer_state
from tether.models.sampling import RowPrompt, render_chat, sample_seeds
from tether.models.scoring import (
    policy_and_reference_logprobs,
    rollout_from_responses,
    rollout_logprobs,
)
from tether.models.sharding import is_sharded, root_gathered
from tether.models.turns import EnvFailed
from tether.run.setup import Run
from tether.trainers.anchor import restore_anchor, text_anchor
from tether.trainers.base import sample_metrics
from tether.trainers.common import (
    RolloutLogprobs,
    UnmeasuredUpdate,
    make_optimizer,
    make_scheduler,
    optimization_state,
    restore_optimization,
    trainer_optimization,
)
from tether.trainers.steps import Advantages, Experience, KLRewards, dpo_pair_loss
from tether.trainers.update import MicroLoss, minibatch_update

log = logging.getLogger(__name__)


class Pairs(NamedTuple):
    """Preference pairs: the record DPO's update selects micro-batches from."""

    prompts: list[str]
    chosen: list[Tensor]
    """response token ids (1-D long), EOS included where the response ended."""
    rejected: list[Tensor]

    share_by = "rows"
    """The DPO loss is a mean over pairs: a micro-batch weighs its share of the minibatch's pairs
    (:func:`tether.trainers.update.micro_shares`)."""

    @property
    def num_rows(self) -> int:
        """The number of pairs."""
        return len(self.prompts)

    def select(self, idx: Tensor) -> Pairs:
        """Pairs ``idx`` ((n,) long), in that order."""
        rows = idx.tolist()
        return Pairs(
            [self.prompts[k] for k in rows], [self.chosen[k] for k in rows], [self.rejected[k] for k in rows]
        )


class PairLogps(NamedTuple):
    """(N,) sequence log-probs (nats, sums over response tokens) of a batch of pairs."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor


def response_text(x) -> str | None:
    """A preference response as text: a string, or a conversational one (a list of messages,
    TRL's format) as the content of its messages, a message's ``tool_calls`` (an assistant turn
    that only calls a tool: content empty or None) as their JSON; None if it is neither."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and all(isinstance(m, dict) for m in x):
        parts = []
        for m in x:
            content, calls = m.get("content"), m.get("tool_calls")
            if not (isinstance(content, str) or (content is None and calls)):
                return None
            parts.append((content or "") + (json.dumps(calls) if calls else ""))
        return "".join(parts)
    return None


def conversation_response_ids(tokenizer, prompt: list, responses: list[list], at: str) -> list[list[int]]:
    """A conversational pair's responses (chosen, rejected) as the tokens TRL's DPO trains on,
    the prompt rendered once for both: for each response, the chat template's
    rendering of ``prompt + response`` after the part it shares with that of ``prompt`` with the
    assistant's turn opened, so the template's end of turn and what follows it (ChatML's
    ``<|im_end|>\\n``) belong to the response, and no EOS is added (TRL 1.16,
    ``DPOTrainer._prepare_dataset``). Where the opened turn holds what the conversation's
    rendering does not (Qwen3's empty think block with ``enable_thinking=false``), the response
    is scored after the prompt as it is sampled, the opened turn whole; TRL scores the same
    tokens after the shorter shared part (and warns).

    Raises:
        ValueError: the two renderings part before the end of the prompt's own messages (the
            response's tokens would carry prompt text), or the response renders to nothing; the
            row named.
    """

    def ids(messages: list, opened: bool) -> list[int]:
        text = render_chat(tokenizer, messages, add_generation_prompt=opened)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    alone, own = ids(prompt, True), ids(prompt, False)
    out = []
    for response in responses:  # the row's own template variables (RowPrompt) kept
        whole = ids(RowPrompt(prompt + response, getattr(prompt, "template_kwargs", {})), False)
        shared = next(
            (i for i, (a, b) in enumerate(zip(whole, alone)) if a != b), min(len(whole), len(alone))
        )
        if shared < len(own) or whole[: len(own)] != own or shared == len(whole):
            raise ValueError(
                f"dpo.pairs: {at}: the chat template renders the prompt's messages otherwise alone than "
                "in the whole conversation (or the response to nothing), so the response's tokens cannot "
                "be told from the prompt's; use a template that renders the messages the same way in both"
            )
        out.append(whole[shared:])
    return out


def read_pair_file(
    path: str,
    tokenizer,
    split: str = "train",
    *,
    heldout_fraction: float | None = None,
    heldout: set[str] | frozenset[str] = frozenset(),
    subset: str | None = None,
) -> tuple[list, list[Tensor], list[Tensor]]:
    """Pairs ``{"prompt", "chosen", "rejected"}`` from a .jsonl file or any dataset
    :func:`tether.data.prompts.load_rows` reads (TRL's preference format, standard or
    conversational: a prompt of messages, chosen and rejected as assistant messages; or TRL's
    implicit-prompt rows, :func:`tether.data.prompts.explicit_pair`). A text response gets EOS
    appended; a conversational one is the template's tokens, as TRL's
    (:func:`conversation_response_ids`).

    Args:
        heldout_fraction: drop the pairs whose prompt the hash split holds out
            (:func:`tether.data.prompts.is_heldout` of its :func:`~tether.data.prompts.prompt_key`),
            so that DPO never trains on a prompt it is evaluated on; None keeps every pair.
        heldout: prompt keys held out by another rule (the run's held-out prompts), dropped too.

    Raises:
        FileNotFoundError, ValueError: missing file, bad JSON or a missing field (the row named);
            no pair left after the held-out prompts are dropped.
    """
    records, where = load_rows(str(path), split, field_name="dpo.pairs", subset=subset)
    prompts, chosen, rejected = [], [], []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for obj, at in zip(records, where):
        obj = explicit_pair(obj, at)  # TRL's implicit-prompt rows: the common prefix is the prompt
        prompt = obj.get("prompt")
        texts = [response_text(obj.get(k)) for k in ("chosen", "rejected")]
        ok_prompt = (isinstance(prompt, str) and prompt) or response_text(prompt)
        if (
            ok_prompt
            and all(texts)
            and len({isinstance(obj[k], list) for k in ("prompt", "chosen", "rejected")}) > 1
        ):
            # a text prompt with message responses (or the other way round) has no one rendering:
            # TRL refuses it too
            kind = "messages" if isinstance(prompt, list) else "text"
            raise ValueError(
                f'dpo.pairs: {at} mixes formats: "prompt" is {kind}, and "chosen" and "rejected" must '
                "then be too (TRL's standard or conversational format)"
            )
        if not ok_prompt or not all(texts):
            raise ValueError(
                f'dpo.pairs: {at} needs non-empty "prompt", "chosen" and "rejected" (strings, or lists '
                "of {role, content} messages)"
            )
        key = prompt_key(prompt)
        if key in heldout or (heldout_fraction is not None and is_heldout(key, heldout_fraction)):
            continue  # a held-out prompt: evaluated on, never trained on
        for k in ("chosen", "rejected"):
            roles = {m.get("role", "assistant") for m in obj[k]} if isinstance(obj[k], list) else set()
            if roles - {"assistant"}:
                # a tool's (or user's) message inside a response was not sampled from the policy:
                # joined into its text, its tokens would carry DPO's gradient and implicit reward as
                # the policy's, and DPO has no mask for them (multi-turn turns: rollout.env, PPO/GRPO/RLOO)
                raise ValueError(
                    f'dpo.pairs: {at} "{k}" holds {sorted(roles - {"assistant"})} messages; DPO scores '
                    "a response as the policy's own tokens, so its messages must all be the assistant's. "
                    "Drop the other turns from the pairs (or move the conversation so far into the prompt)"
                )
        prompts.append(prompt)
        pair = (
            conversation_response_ids(tokenizer, prompt, [obj["chosen"], obj["rejected"]], at)
            if isinstance(prompt, list)
            # EOS appended where the text does not end with it already (TRL's add_eos)
            else [
                tokenizer(text, add_special_tokens=False)["input_ids"]
                + (eos if not (tokenizer.eos_token and text.endswith(tokenizer.eos_token)) else [])
                for text in texts
            ]
        )
        for ids, out in zip(pair, (chosen, rejected)):
            out.append(torch.tensor(ids, dtype=torch.long, device="cpu"))
    if not prompts:
        raise ValueError(
            f"dpo.pairs: {path} holds no pairs"
            + (
                f" outside the held-out prompts (data.heldout_fraction={heldout_fraction:g}); lower it"
                if records and heldout_fraction is not None
                else ""
            )
        )
    return prompts, chosen, rejected


class DPOTrainer:
    name = "dpo"

    def __init__(self, run: Run):
        self.run = run
        c = self.cfg = run.config
        run.policy.value_head.requires_grad_(
            False
        )  # DPO has no value loss; DDP then waits for no gradient of it
        self.params = [p for p in run.policy.lm.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(
                "model.trainable_layers=0 leaves DPO nothing to train; raise it or leave it unset"
            )
        self.accelerator = run.accelerator
        self.model = (  # DDP under accelerate; an FSDP-sharded policy syncs its own gradients
            run.accelerator.prepare(run.policy)
            if run.accelerator and not is_sharded(run.policy)
            else run.policy
        )
        self.optimizer = make_optimizer(self.params, c.optim.lr, c.optim.weight_decay, c.optim.fused_adamw)
        self.device = next(run.policy.parameters()).device
        # the pair-order RNG stays on the host: the same order on any device (checkpointed)
        self.generator = torch.Generator(device="cpu").manual_seed(c.train.seed)
        self.pairs = self.build_pairs()
        self.position = 0
        self.fused = bool(self.optimizer.param_groups[0].get("fused"))  # False where no fused kernel
        self.per_step = c.optim.epochs * -(
            -min(c.rollout.batch_size, len(self.pairs.prompts)) // c.optim.minibatch_size
        )
        self.schedule_steps = c.train.steps * self.per_step  # optimizer steps; a resume may change it
        self.scheduler = make_scheduler(
            self.optimizer, c.optim.lr_scheduler, c.optim.warmup_steps, self.schedule_steps
        )
        self.last_experience: Experience | None = None
        # anchor.coef > 0 or anchor.budget: human text in every optimizer step's loss (trainers/anchor.py)
        self.anchor = text_anchor(run)

    def trainer_state(self, step: int):
        """``transformers.TrainerState`` after ``step`` steps: ``epoch`` the passes over the pairs
        (``rollout.batch_size`` of them a step, all of them when fewer)."""
        c, n = self.cfg, len(self.pairs.prompts)
        return trainer_state(step, c.train.steps, step * min(c.rollout.batch_size, n) / max(1, n))

    # ---- pairs -----------------------------------------------------------------------------
    @torch.no_grad()
    def build_pairs(self) -> Pairs:
        c, run = self.cfg, self.run
        if c.dpo.pairs == "sampled":
            return Pairs(*self.sample_pairs())
        held = {prompt_key(p) for p in run.heldout_prompts.prompts}
        return Pairs(
            *read_pair_file(
                c.dpo.pairs,
                run.tokenizer,
                c.data.split,
                # with its own held-out set (data.eval_prompts, eval_dataset) no hash share is held out
                heldout_fraction=None if c.data.eval_prompts else c.data.heldout_fraction,
                heldout=held,
                subset=c.data.config,
            )
        )

    def sample_pairs(self) -> tuple[list[str], list[Tensor], list[Tensor]]:
        """Best-vs-worst of ``dpo.candidates`` reference samples per prompt, ties skipped."""
        c, run = self.cfg, self.run
        k = c.dpo.candidates
        sampler = PromptSampler(run.train_prompts, c.train.seed + 1)
        prompts, chosen, rejected = [], [], []
        per_call = max(1, c.eval.batch_size // k)
        tried = unscored = 0
        while len(prompts) < c.dpo.n_pairs:
            if tried >= 4 * c.dpo.n_pairs + 64:
                raise ValueError(
                    f"dpo.pairs=sampled: only {len(prompts)} of {c.dpo.n_pairs} prompts gave candidates with "
                    f"different scores after {tried} tries (ties are skipped"
                    + (
                        f"; the reward returned None for {unscored} of {tried * k} candidates, which are "
                        "never paired: a prompt needs two scored ones"
                        if unscored
                        else ""
                    )
                    + "); raise dpo.candidates or rollout.max_new_tokens, use a finer-grained reward.scorer"
                    + (" (or one that scores these candidates)" if unscored else "")
                    + ", or give a pairs file"
                )
            chosen_rows = sampler.next_indices(per_call)
            batch = run.train_prompts.select(chosen_rows)
            candidates = run.train_prompts.select([i for i in chosen_rows for _ in range(k)])
            # seeded by candidate index (step -1: not a training step), the same on every process
            ro = run.sampler.sample(
                run.reference,
                candidates,
                sample_seeds(c.train.seed, -1, range(tried * k, (tried + per_call) * k)),
                weights=run.reference,  # FSDP: gathered as train.sharded_generation says
            )
            tried += per_call
            ro.columns = candidates.columns
            # an unscored candidate (None) is never chosen nor rejected; before the first step
            total = score_rollout(
                run.scorer, ro, "DPO pair sampling", state=trainer_state(0, c.train.steps)
            ).total
            scores = torch.tensor(total, device="cpu").view(
                -1, k
            )  # (prompts, k), read on the host one by one
            unscored += int(torch.isnan(scores).sum())
            for g, prompt in enumerate(batch):
                scored = ~torch.isnan(scores[g])  # (k,) a candidate no reward scored is left out
                if int(scored.sum()) < 2:
                    continue
                best = int(torch.where(scored, scores[g], -torch.inf).argmax())
                worst = int(torch.where(scored, scores[g], torch.inf).argmin())
                if scores[g, best] == scores[g, worst]:
                    continue
                rows = (g * k + best, g * k + worst)
                (cb, cw) = (ro.response_ids[r][ro.response_mask[r]] for r in rows)
                prompts.append(prompt)
                chosen.append(cb)
                rejected.append(cw)
        n = c.dpo.n_pairs
        return prompts[:n], chosen[:n], rejected[:n]

    def sequence_logps(self, model, prompts: list[str], responses: list[Tensor]) -> Tensor:
        ro = rollout_from_responses(
            self.run.tokenizer, prompts, responses, self.cfg.rollout.max_prompt_tokens, self.device
        )
        lp = rollout_logprobs(
            model,
            ro,
            self.cfg.rollout.temperature,
            head_chunk=self.run.policy.head_chunk,
            share_prefix=self.run.policy.scoring_share_prefix,
        ).logprobs
        return masked_sum(lp, ro.response_mask, dim=-1)  # (N,)

    def pair_logps(self, pairs: Pairs) -> PairLogps:
        """Policy (with grad) and reference sequence log-probs of ``pairs``, computed on the same
        padded batch.

        The reference's sequence log-probs are computed here, in the very batch (same rows, same
        padding widths, same kernels) that the policy's are, as TRL does by default
        (``precompute_ref_log_probs=False``). Precomputed in other batches, the padding widths
        differed and a pair's policy and reference log-probs at step 0 differed by float rounding
        (up to 3.8e-6 nats on a tiny model; NeMo-Aligner issue #227); computed together they are
        equal bit for bit, so every step-0 margin is exactly 0. It costs one no-grad reference
        forward per micro-batch.
        """
        with torch.no_grad(), root_gathered(self.run.reference):
            ref_chosen = self.sequence_logps(self.run.reference, pairs.prompts, pairs.chosen)
            ref_rejected = self.sequence_logps(self.run.reference, pairs.prompts, pairs.rejected)
        return PairLogps(
            self.sequence_logps(self.model, pairs.prompts, pairs.chosen),
            self.sequence_logps(self.model, pairs.prompts, pairs.rejected),
            ref_chosen,
            ref_rejected,
        )

    def pair_loss(self, rows: Tensor) -> DPOLoss:
        """The DPO loss of pairs ``rows`` (:meth:`pair_logps`, :func:`tether.core.losses.dpo_loss`)."""
        return dpo_loss(*self.pair_logps(self.pairs.select(rows)), self.cfg.dpo.beta)

    def minibatch_loss(self, pairs: Pairs, first_micro: bool = True) -> MicroLoss:
        """The loss of micro-batch ``pairs`` (``self.pairs.select(rows)``), a mean over its pairs;
        ``first_micro`` is unused (DPO has no once-per-step term)."""
        return dpo_pair_loss(*self.pair_logps(pairs), self.cfg.dpo.beta)

    def minibatches(self, batch: Tensor) -> Iterator[Tensor]:
        """This process's contiguous ``1 / world`` of each minibatch of every epoch, in update
        order; each epoch permutes ``batch`` (pair indices) with the trainer's generator when it
        starts."""
        for _ in range(self.cfg.optim.epochs):
            perm = batch[torch.randperm(len(batch), generator=self.generator, device="cpu")]
            for minibatch in perm.split(self.cfg.optim.minibatch_size):
                yield minibatch[D.shard(len(minibatch))]

    def state_dict(self, with_optimizer: bool = True) -> dict:
        # without the optimizer: a sharded run's checkpoint holds it in its sharded files
        state = {"optimizer": self.optimizer.state_dict()} if with_optimizer else {}
        return state | {
            "generator": self.generator.get_state(),
            "position": self.position,
            **({"anchor": self.anchor.state_dict()} if self.anchor is not None else {}),
            **optimization_state(self),
        }

    def load_state_dict(self, state: dict, next_step: int | None = None) -> None:
        """Restore :meth:`state_dict`; ``next_step``: the step the resumed run trains first. The
        optimizer's settings are the resumed config's, a change printed
        (:func:`tether.trainers.common.restore_optimization`)."""
        self.generator.set_state(state["generator"])
        self.position = state["position"]
        restore_anchor(self.anchor, state.get("anchor"))
        restore_optimization(self, state, next_step)  # the optimizer, and its schedule resumed

    # ---- the step --------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        c, P = self.cfg, self.pairs
        t0 = time.perf_counter()
        # 1. the next batch of pairs (cycling)
        N, B = len(P.prompts), c.rollout.batch_size
        # fewer pairs than a batch: a multiple of the number of processes, so that every minibatch
        # (the last one too) splits evenly over them
        n = min(B, N) - min(B, N) % D.world_size()
        if n == 0:
            raise ValueError(
                f"dpo: {N} preference pairs cannot be split over {D.world_size()} processes; "
                "raise dpo.n_pairs (or give a larger dpo.pairs file)"
            )
        batch = torch.tensor([(self.position + i) % N for i in range(n)], device="cpu")  # pair ids
        self.position = (self.position + len(batch)) % N
        # 2. DPO epochs; this process takes a contiguous 1 / world of each minibatch. The loss is a
        #    mean over pairs: scaled by this process's share of the pairs (and by world, as DDP
        #    averages gradients) the gradient is that of the whole minibatch
        lr = self.optimizer.param_groups[0]["lr"]  # the rate of this step's first optimizer step
        update = minibatch_update(
            P,
            self.minibatches(batch),
            minibatch_loss=self.minibatch_loss,
            optimization=trainer_optimization(self, "DPO"),
            micro_batch_size=c.optim.micro_batch_size,
            step_term=self.anchor.term if self.anchor is not None else None,
        )
        t_update = time.perf_counter()
        head = {
            "step": step,
            "samples": (step + 1) * len(batch),
            "objective/kl_coef": c.dpo.beta,
            "optim/lr": lr,
        }
        # 3. the real KL and score of the policy's own samples on held-out prompts
        try:
            probe = self.probe(step)
        except (ScorerStopped, ScorerFailed, EnvFailed) as e:  # after the update, which is kept
            self.last_experience = None  # no samples of this step to log
            raise UnmeasuredUpdate(
                e,
                {
                    **head,
                    **update.metrics(),
                    "time/step": time.perf_counter() - t0,
                    "time/update": t_update - t0,
                },
                "its probe's metrics (objective/*, the policy's samples after the update)",
            ) from None
        t_probe = time.perf_counter()
        # 4. metrics
        row = {
            **head,
            **probe,
            **update.metrics(),
            "time/step": t_probe - t0,
            "time/update": t_update - t0,
            "time/probe": t_probe - t_update,
        }
        return row

    @torch.no_grad()
    def probe(self, step: int) -> dict:
        c, run = self.cfg, self.run
        k, world = c.dpo.kl_eval_prompts, D.world_size()
        prompts = run.heldout_prompts[:k]
        if len(prompts) < world:  # too few held out to give every process one: training prompts
            prompts = run.train_prompts[:k]
        prompts = prompts[: len(prompts) - len(prompts) % world]  # an equal share for every process
        if not prompts:
            return {}
        mine = D.shard(len(prompts))  # this process's share of the probe
        seeds = sample_seeds(c.eval.seed, step, range(len(prompts))[mine])
        prompts = prompts[mine]
        # FSDP: the policy's weights gathered as train.sharded_generation says
        ro = run.sampler.sample(run.policy.lm, prompts, seeds, weights=run.policy)
        with root_gathered(run.policy, run.reference):
            pol, ref, exact = policy_and_reference_logprobs(
                run.policy,
                run.reference,
                ro,
                c.rollout.temperature,
                exact_kl=c.kl.exact,
                kl_chunk_size=c.kl.exact_chunk_size,
            )
        mask = ro.response_mask
        kl = estimate_kl(pol.logprobs, ref.logprobs, c.kl.estimator)
        ro.columns = prompts.columns
        # the probe follows this step's update: step + 1 steps done, (step + 1) batches of pairs
        state = trainer_state(
            step + 1, c.train.steps, (step + 1) * c.rollout.batch_size / max(1, len(self.pairs.prompts))
        )
        # an unscored sample (None) leaves the score's statistics (NaN)
        scores = torch.tensor(score_rollout(run.scorer, ro, step, state=state).total, device=self.device)
        shaped = shape_rewards(torch.nan_to_num(scores, nan=0.0), kl, c.dpo.beta, mask)
        forwards = RolloutLogprobs(
            pol.logprobs, ref.logprobs, values=None, entropy=pol.entropy, exact_kl=exact
        )
        self.last_experience = Experience(
            rollout=ro,
            scores=scores,
            forwards=forwards.step_forwards(),
            leashed=KLRewards(kl=kl, rewards=shaped.rewards, non_score_reward=shaped.non_score_reward),
            adv=Advantages(advantages=torch.zeros_like(kl), returns=None, return_scale=None),
            minibatches=[],
        )
        # beta is DPO's leash; the row's objective/kl_coef is set by the caller to the same beta
        return sample_metrics(
            ro, scores, kl=kl, forwards=forwards, kl_coef=c.dpo.beta, estimator=c.kl.estimator
        )
