"""The fluency judge: how likely an independent language model finds each response.

The seeds: the KL penalty "preserves fluency". tether measures it as the per-token negative
log-likelihood of a response given its prompt, ``-1/|y| sum_t log q(y_t | x, y_<t)`` in nats per
token (``exp`` of it is the perplexity), under a causal LM ``q`` of another family than the
policy (by default Gemma-3-270M, from a PyPI package: ``../shared/MODELS.md``), so that the
policy cannot have learned the judge's own quirks. Fluent text scores low (about 2.5 nats per
token on a review sentence); keyword strings that game a sentiment scorer ("great great great
love love") score high (about 5.8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tether.models.head import left_padded, position_ids_from_mask

DEFAULT_FLUENCY_MODEL = "gemma3-270m"
"""The judge ``eval.fluency_model=auto`` turns on: Gemma-3-270M (base), embedded from a PyPI
package."""

JUDGE_PARAMS = {"gemma3-270m": 268_098_176}
"""Parameters of the embedded fluency judges (counted in their safetensors), what
:func:`fluency_cost_share` weighs before any of them loads."""

AUTO_SHARE = 0.25
"""The most compute ``eval.fluency_model=auto`` lets the judge add to a run on data other than
the demo's, as a share of the training's (:func:`fluency_cost_share`). A 2-step DPO run on a
user's pairs measured 234 s with the judge against 42 s without (its forwards were 5x the
training's): such a run turns it off; a run of hundreds of steps keeps it."""


def fluency_cost_share(
    *,
    judge_params: int,
    judged_responses: int,
    policy_params: int,
    trained_sequences: int,
    forwards_per_sequence: float,
    tokens: int,
) -> float:
    """The fluency judge's compute over a run as a share of the training's: ``2 Pj N_j /
    (Pp N_t f)``, with a forward at 2 FLOPs per parameter per token and every sequence (judged
    or trained) ``tokens`` long, so the lengths cancel but stay in the signature for the record.

    Args:
        judge_params: the judge's parameters (Pj).
        judged_responses: the responses it reads over the run (N_j: each evaluation's held-out
            responses, the reference's once).
        policy_params: the policy's parameters (Pp).
        trained_sequences: the sequences the training processes (N_t: steps x rows per step).
        forwards_per_sequence: f, forward-equivalents of compute per trained sequence at 2 FLOPs
            per parameter per token (an update, forward and backward, is 3; sampling, the
            reference's and the old policy's scoring 1 each).
        tokens: the length of a sequence, tokens (> 0).

    Returns:
        The share (>= 0); ``inf`` where the training processes nothing.
    """
    train = policy_params * trained_sequences * forwards_per_sequence * tokens
    judge = judge_params * judged_responses * tokens
    return judge / train if train > 0 else float("inf")


def prefix_text(prompt) -> str:
    """The text the fluency judge reads a response after: a prompt as written, or a conversation's
    messages' contents, one per line (the judge is another model, with no template of the
    policy's; what it measures is the response's fluency, not the prompt's format)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


class FluencyJudge:
    """Per-token NLL (nats) of each response given its prompt under a frozen causal LM.

    The prompt is tokenized with the tokenizer's special tokens (Gemma needs its BOS: its
    perplexity on prose is ~34 with it and ~200 without, ``../shared/MODELS.md``), the response
    without, and the two are joined, so the response is scored exactly as the judge would
    continue the prompt. Rows are left-padded and only the response positions' logits are
    computed (``logits_to_keep``), so the judge's large vocabulary costs memory only where it is
    read.

    Args:
        name: an embedded model (``gemma3-270m``), a local folder or a Hub id.
        device: where the judge runs.
        batch_size: rows per forward (bounds the ``(batch, response, vocab)`` logits: 16 rows x 24
            tokens x 262,144 words of float32 is 400 MB).
        revision: Hub revision of ``name``.

    Raises:
        FileNotFoundError, RuntimeError: the model cannot be found or its package is missing
            (from :func:`tether.models.loading.resolve_model_path`).
    """

    def __init__(
        self,
        name: str = DEFAULT_FLUENCY_MODEL,
        device: torch.device | str = "cpu",
        batch_size: int = 16,
        revision: str | None = None,
    ):
        from transformers import AutoTokenizer

        from tether.models.loading import load_causal_lm, resolve_model_path

        path = resolve_model_path(name, revision, field_name="eval.fluency_model")
        self.name, self.batch_size, self.device = name, batch_size, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = load_causal_lm(path).to(self.device)
        self.model.requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    @torch.no_grad()
    def __call__(self, prompts: Sequence, responses: Sequence[str]) -> list[float | None]:
        """Per-token NLL of ``responses[i]`` given ``prompts[i]``, nats per token (float32 log-softmax).

        Returns:
            One value per response; None for a response with no token (nothing to judge).

        Raises:
            ValueError: ``prompts`` and ``responses`` differ in length.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        return continuation_nll(
            self.model,
            self.tokenizer,
            prefixes=[prefix_text(p) for p in prompts],
            continuations=responses,
            batch_size=self.batch_size,
            pad_id=self.pad_id,
        )


@torch.no_grad()
def continuation_nll(
    model, tokenizer, prefixes: Sequence[str], continuations: Sequence[str], batch_size: int, *, pad_id: int
) -> list[float | None]:
    """Per-token NLL of each continuation given its prefix under a causal LM, nats per token
    (float32 log-softmax, float64 mean) of :func:`continuation_logprobs`.

    Returns:
        One value per continuation; None for one with no token.
    """
    return mean_nll(
        continuation_logprobs(model, tokenizer, prefixes, continuations, batch_size, pad_id=pad_id)
    )


def mean_nll(logprobs: Sequence[Sequence[float] | None]) -> list[float | None]:
    """Each sequence's mean negative log-prob per token (a float64 mean, nats per token) of
    :func:`continuation_logprobs`' lists; None where a sequence has no token."""
    return [None if lp is None else float(-torch.tensor(lp, dtype=torch.float64).mean()) for lp in logprobs]


def continuation_logprobs(
    model, tokenizer, prefixes: Sequence[str], continuations: Sequence[str], batch_size: int, *, pad_id: int
) -> list[list[float] | None]:
    """The log-probability of each token of each continuation given its prefix under a causal LM,
    nats (float32 log-softmax): the prefix tokenized with the tokenizer's special tokens, the
    continuation without, joined, left-padded in batches of ``batch_size`` rows of similar
    length, only the continuation's positions' logits computed (:class:`FluencyJudge`).

    Returns:
        One list per continuation, a log-prob per token of it (tokenized as
        ``tokenizer(continuation, add_special_tokens=False)``); None for one with no token.
    """
    tok = tokenizer
    device = next(model.parameters()).device
    pairs = [
        (tok(p).input_ids, tok(r, add_special_tokens=False).input_ids)
        for p, r in zip(prefixes, continuations)
    ]
    out: list[list[float] | None] = [None] * len(pairs)
    order = sorted((i for i, (_, r) in enumerate(pairs) if r), key=lambda i: len(pairs[i][1]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        resp_len = max(len(pairs[i][1]) for i in rows)
        ids, attn = left_padded([pairs[i][0] + pairs[i][1] for i in rows], pad_id, device)
        # left padding: every row's continuation sits in the last resp_len positions, predicted
        # by the logits of the resp_len positions before them; positions count from each row's
        # first real token, so a padded row is scored as if it stood alone
        positions = position_ids_from_mask(attn)
        logits = model(
            input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=resp_len + 1
        ).logits[:, :-1]  # (b, resp_len, V)
        targets = ids[:, -resp_len:]  # (b, resp_len)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
        for j, i in enumerate(rows):
            n = len(pairs[i][1])
            out[i] = logp[j, resp_len - n :].tolist()
    return out
