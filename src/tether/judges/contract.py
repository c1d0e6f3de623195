"""The scorer contract: what a reward function or judge is, and the check every call passes.

A scorer is any ``Callable[[list[str]], Sequence[float]]`` of the responses, or a TRL-style reward
function (:func:`takes_prompts`), called exactly as TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer``
call one (``_calculate_rewards``)::

    f(prompts=..., completions=..., completion_ids=..., **columns,
      trainer_state=..., log_extra=..., log_metric=...)

* ``prompts``: the dataset's prompts, as the dataset holds them: strings, or conversations (lists
  of ``{"role", "content"}`` messages).
* ``completions``: the decoded responses (special tokens skipped), strings for string prompts;
  for conversations each is ``[{"role": "assistant", "content": text}]``, the one-message list TRL
  builds (:func:`trl_completions`); a multi-turn rollout through the chat template passes its
  messages, assistant and ``tool`` in turn, as TRL's tool loop does.
* ``completion_ids``: the token ids of each response, a ``list[list[int]]`` up to and
  including the first end token (EOS or another of the model's end ids), no padding: TRL's
  ``completion_ids_list``, i.e. ``response_ids[response_mask]`` row by row; in a multi-turn
  rollout the whole transcript, the environment's tokens between the policy's included
  (``response_mask | env_mask``), as TRL's tool loop passes them.
* every dataset column of the prompts' rows (one value per sample), by name;
* ``env_replies`` (tether's, in a multi-turn rollout only, to a function that names it:
  :data:`ENV_REPLIES`): B lists of the texts the environment wrote after the policy's turns, in
  order, as appended (a raw reply cut at the token budget is cut here too). A raw transcript is
  one string, so this is how a reward tells a tool's answer from text the policy wrote to look like
  one. A function that takes ``**kwargs`` without naming it does not get it: it gets TRL's
  keywords exactly (one that hands its ``**kwargs`` on to a stricter function keeps working);
* ``trainer_state``: a ``transformers.TrainerState`` (:func:`trainer_state`; ``global_step``,
  ``max_steps``, ``epoch``), ``log_extra(column, values)`` and ``log_metric(name, value)``
  (:class:`RewardLog`).

A function gets the keywords it names (all of them when it takes ``**kwargs``); an ``async
def`` function is awaited, as TRL awaits one. Every call goes through :func:`checked_scores`,
which refuses a wrong count or a non-finite score with the step named. A None score (TRL's
marker: the reward does not apply to the sample) is taken where the samples are trained on or
compared: such an unscored sample leaves every statistic, as in TRL.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

from tether.core.text import shown

if TYPE_CHECKING:  # the record scored (models sits below judges); for the type only
    from tether.models.sampling import Rollout

Scorer = Callable[[list[str]], Sequence[float]]

log = logging.getLogger(__name__)


FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: scores beyond it would become inf in the reward tensors."""

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The keywords TRL 1.16 passes every reward function besides the dataset columns
(``GRPOTrainer._calculate_rewards``; RLOO's is the same): a dataset column never replaces one."""


ENVIRONMENTS = "environments"
"""TRL's keyword for the rows' environment objects (``environment_factory``), given to every
reward function that names it or takes ``**kwargs`` in a run with one."""

ENV_REPLIES = "env_replies"
"""The keyword a multi-turn rollout's environment texts reach a reward under (module docstring);
not TRL's (its tool runs pass messages, whose roles tell the tool's text apart). A dataset column
of this name is refused (:func:`tether.models.turns.env_column_names`' caller)."""


class ScorerStopped(RuntimeError):
    """A scorer raised ``SystemExit`` (``sys.exit``, ``exit()``) or ``KeyboardInterrupt``: the run
    stops with this message instead of ending silently (or with the scorer's exit status)."""


class ScorerFailed(ValueError):
    """A scorer raised an exception (or returned what is not one finite float per text): the
    message names the step and the scorer's error. A ``ValueError``, so that callers that catch
    bad input keep catching it; the training loop catches it to keep the step before
    (checkpointed, ``--resume`` named), as it does for :class:`ScorerStopped`."""


class ArgumentError(ValueError):
    """A reward function needs an argument (a dataset column, the prompts) the call does not have."""


def takes_prompts(scorer: Callable) -> bool:
    """True when ``scorer`` is a TRL-style reward function, called with keywords as TRL calls it
    (module docstring): it names one of :data:`TRL_ARGUMENTS` (``completions``,
    ``completion_ids``, ``prompts`` ...), or takes keywords only (``def f(**kwargs)``: no required
    positional parameter and no ``*args``). Anything else is a plain scorer, called as
    ``scorer(texts)`` with the decoded responses."""
    try:
        params = inspect.signature(scorer).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    if any(name in params for name in TRL_ARGUMENTS):
        return True
    kinds = [p.kind for p in params.values()]
    positional_required = any(
        p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in params.values()
    )
    return (
        inspect.Parameter.VAR_KEYWORD in kinds
        and inspect.Parameter.VAR_POSITIONAL not in kinds
        and not positional_required
    )


def _plain_call_hint(scorer: Callable) -> str:
    """For a failed plain call of a ``f(*args, **kwargs)`` callable: how it was called and how to
    get TRL's keyword call (a wrapper of a plain scorer takes that form too, so it stays plain)."""
    try:
        kinds = {p.kind for p in inspect.signature(scorer).parameters.values()}
    except (TypeError, ValueError):
        return ""
    if (
        takes_prompts(scorer)
        or not {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds
    ):
        return ""
    return (
        " (it takes *args and **kwargs and names no TRL argument, so it was called as a plain scorer, "
        "f(texts); for TRL's keyword call name its parameters: def f(prompts, completions, **kwargs))"
    )


def required_arguments(scorer: Callable) -> list[str]:
    """The dataset columns a TRL-style reward function needs: its parameters without a default
    that are not one of :data:`TRL_ARGUMENTS` (those come with every call); [] for a plain
    scorer."""
    if not takes_prompts(scorer):
        return []
    params = inspect.signature(scorer).parameters
    return [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n not in TRL_ARGUMENTS
    ]


def is_conversational(prompts: Sequence | None) -> bool:
    """True when the prompts are conversations: the first is a list of messages (dicts with a
    ``role``), TRL's ``is_conversational({"prompt": prompts[0]})`` (it looks at the first only)."""
    if not prompts:
        return False
    first = prompts[0]
    return isinstance(first, list) and bool(first) and isinstance(first[0], dict) and "role" in first[0]


def trl_completions(prompts: Sequence | None, texts: list[str]) -> list:
    """The ``completions`` TRL passes: ``texts`` for string prompts (or none); for conversations
    ``[[{"role": "assistant", "content": text}], ...]``, as TRL 1.16 builds them
    (``GRPOTrainer._generate``, ``RLOOTrainer._generate``: the decoded text as the content of one
    assistant message; a prompt ending in an assistant turn adds nothing to it)."""
    if is_conversational(prompts):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def completion_texts(completions: Sequence) -> list[str]:
    """The texts of :func:`trl_completions`' ``completions``: a string is itself, a message list
    the contents of its messages, one per line (one assistant message: its content; a tool run's
    ``[assistant, tool, assistant]``: three lines, so that a tool's ``78`` and the answer ``78``
    after it do not read ``7878``)."""
    return [c if isinstance(c, str) else "\n".join(str(m.get("content", "")) for m in c) for c in completions]


def trainer_state(global_step: int = 0, max_steps: int = 0, epoch: float = 0.0, **fields):
    """The ``trainer_state`` a reward function gets: a ``transformers.TrainerState``, the class
    TRL passes (``self.state``), with the fields TRL's reward functions read.

    Args:
        global_step: training steps done before this call (tether's step, from 0; in TRL the
            optimizer steps done, which is the number of generation rounds at TRL's defaults).
        max_steps: the run's ``train.steps``.
        epoch: passes over the training prompts so far (float).
        **fields: other ``TrainerState`` fields (``train_batch_size``, ``num_train_epochs`` ...).

    Returns:
        ``transformers.TrainerState``.
    """
    from transformers import TrainerState

    return TrainerState(global_step=int(global_step), max_steps=int(max_steps), epoch=float(epoch), **fields)


class RewardLog:
    """What reward functions logged through TRL's ``log_metric`` and ``log_extra`` in one step.

    Attributes:
        metrics: name -> the values ``log_metric(name, value)`` gave, in call order.
        extra: column -> the values ``log_extra(column, values)`` gave (one per sample).
    """

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar for this step (averaged with the step's others)."""
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a column for the step's completions, one value per sample."""
        self.extra[column].extend(values)

    def replay(self, log_metric: Callable | None, log_extra: Callable | None) -> None:
        """Pass everything logged here on to another pair of hooks (a reward list's caller's)."""
        for name, values in self.metrics.items():
            for v in values:
                if log_metric is not None:
                    log_metric(name, v)
        for column, values in self.extra.items():
            if log_extra is not None:
                log_extra(column, values)

    def step_metrics(self) -> dict[str, float]:
        """``reward_metric/<name>``: the mean of each name's values over this step's calls on every
        process (collective: every process calls it). Units are the reward function's."""
        from tether.core import distributed as D

        merged: dict[str, list[float]] = defaultdict(list)
        for part in D.gather_objects(dict(self.metrics)):
            for name, values in part.items():
                merged[name] += values
        return {f"reward_metric/{n}": sum(v) / len(v) for n, v in sorted(merged.items()) if v}


class RewardCall(NamedTuple):
    """One scoring call's inputs, as TRL's ``_calculate_rewards`` has them (module docstring):
    built once by :func:`checked_scores` or :func:`score_rollout`, and for each reward of a list."""

    texts: list[str]
    """The B decoded responses (special tokens skipped, end token excluded)."""
    step: int | str
    """A training step, or a phrase for messages (``"held-out evaluation"``)."""
    prompts: Sequence | None = None
    """B prompts as the dataset holds them (strings or conversations), or None."""
    columns: dict[str, list] | None = None
    """The dataset columns, name -> B values."""
    completion_ids: Sequence[Sequence[int]] | None = None
    """B lists of token ids, or None (a call with texts only)."""
    state: object = None
    """The ``trainer_state``; None passes ``trainer_state(global_step=step)``."""
    reward_log: RewardLog | None = None
    """Collects ``log_metric`` / ``log_extra``; None drops them."""
    completions: list | None = None
    """B message lists of a multi-turn chat rollout (replacing :func:`trl_completions`), or None."""
    env_replies: Sequence[Sequence[str]] | None = None
    """A multi-turn rollout's environment texts, B lists, or None."""

    @property
    def where(self) -> str:
        """The step as messages name it."""
        return f"step {self.step}" if isinstance(self.step, int) else self.step


def _keywords(scorer: Callable, call: RewardCall) -> dict:
    """The keyword arguments of a TRL-style call (module docstring): TRL's own arguments, then
    every dataset column the function names (all of them when it takes ``**kwargs``), and
    :data:`ENV_REPLIES` when given and named. ``completions`` given (a multi-turn rollout's
    messages) replaces :func:`trl_completions`."""
    prompts, texts, columns, completion_ids = call.prompts, call.texts, call.columns, call.completion_ids
    state, completions, env_replies = call.state, call.completions, call.env_replies
    reward_log = call.reward_log if call.reward_log is not None else RewardLog()
    params = inspect.signature(scorer).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {
        "prompts": list(prompts) if prompts is not None else None,
        "completions": trl_completions(prompts, texts) if completions is None else list(completions),
        "trainer_state": state,
        "log_extra": reward_log.log_extra,
        "log_metric": reward_log.log_metric,
    }
    if completion_ids is not None:
        kw["completion_ids"] = [[int(t) for t in ids] for ids in completion_ids]
    for name, values in (columns or {}).items():
        if name not in TRL_ARGUMENTS and (takes_all or name in params):
            kw[name] = list(values)
    if env_replies is not None and ENV_REPLIES in params:  # named only: **kwargs get TRL's keywords
        kw[ENV_REPLIES] = [list(r) for r in env_replies]
    if not takes_all:
        kw = {k: v for k, v in kw.items() if k in params}
    needed = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    missing = [n for n in needed if n not in kw or kw[n] is None]
    if missing:
        raise ArgumentError(
            _missing_message(missing, kw, columns, n_texts=len(texts), env=env_replies is not None)
        )
    return kw


_MISSING_HINTS = {
    "prompts": " (it takes prompts, and none came with the {n} texts)",
    "completion_ids": " (it takes completion_ids, and no token ids came with the {n} texts)",
    ENV_REPLIES: " (env_replies come with a multi-turn rollout only: rollout.env)",
}
"""Why a keyword a reward function requires can be missing from a call, by keyword."""


def _missing_message(missing: list[str], kw: dict, columns: dict | None, *, n_texts: int, env: bool) -> str:
    """:class:`ArgumentError`'s message: what the function takes, what the call has, and why."""
    have = [k for k in ("prompts", "completions", "completion_ids") if kw.get(k) is not None]
    have += ["trainer_state", "log_extra", "log_metric", *sorted(columns or {})]
    have += [ENV_REPLIES] if env else []
    hint = next((_MISSING_HINTS[k].format(n=n_texts) for k in _MISSING_HINTS if k in missing), "")
    return f"it takes {missing}, and the call has {have}{hint}"


@contextmanager
def _reported(where: str, n_texts: int, scorer: Callable) -> Iterator[None]:
    """Turn what a user's scorer raises into tether's errors, with the step (``where``) named:
    ``SystemExit`` and ``KeyboardInterrupt`` into :class:`ScorerStopped` (never a silent end with
    the scorer's status), any other exception into a :class:`ScorerFailed` (never a bare
    traceback); a :class:`ScorerStopped` or :class:`ScorerFailed` of a reward inside a reward list
    is told once, ``where`` put before its own message (not wrapped in a second "failed")."""
    try:
        yield
    except (ScorerStopped, ScorerFailed) as e:  # a reward of a list's, told already: where added
        if not where or str(e).startswith(f"{where}: "):
            raise
        raise type(e)(f"{where}: {e}") from e.__cause__
    except SystemExit as e:
        raise ScorerStopped(
            f"{where}: the scorer raised SystemExit({e.code!r}), as sys.exit() raises; a reward "
            "function returns scores and never ends the process"
        ) from None
    except KeyboardInterrupt:  # a second Ctrl-C while it ran, or the scorer's own
        raise ScorerStopped(
            f"{where}: interrupted (Ctrl-C, or KeyboardInterrupt) while the scorer ran"
        ) from None
    except Exception as e:  # a user's scorer: report it with the step, never a bare traceback
        raise ScorerFailed(
            f"{where}: the scorer failed on {n_texts} texts ({type(e).__name__}: {e})"
            + ("" if isinstance(e, ArgumentError) else "; it must return one float per text")
            + _plain_call_hint(scorer)
        ) from e


def _call(scorer: Scorer, call: RewardCall):
    """The scorer's raw output for ``call`` (:func:`checked_scores`' call, unchecked): what it
    returned, an awaitable when it is ``async def``."""
    texts = call.texts
    if not takes_prompts(scorer):
        return scorer(texts)
    for name in ("prompts", "completion_ids", "completions", "env_replies"):
        given = getattr(call, name)
        if given is not None and len(given) != len(texts):
            raise ValueError(f"{len(given)} {name} came with the {len(texts)} texts")
    if call.state is None:
        call = call._replace(state=trainer_state(call.step if isinstance(call.step, int) else 0))
    return scorer(**_keywords(scorer, call))


def _kind(value) -> str:
    """A value's kind in words, for a refusal: ``a dict``, ``a str``, ``a 2-D ndarray``."""
    name = type(value).__name__
    ndim = getattr(value, "ndim", None)
    if isinstance(ndim, int) and ndim != 1 and hasattr(value, "tolist"):
        return f"a {ndim}-D {name}"
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _score(s):
    """A returned score as a Python value: a NumPy or torch scalar (a 0-D array or tensor) as
    the number it holds, anything else as it is."""
    if getattr(s, "ndim", None) == 0 and hasattr(s, "item"):
        return s.item()
    return s


def _floats(raw, allow_none: bool, where: str) -> tuple[list, list[float]]:
    """``(raw as a list, its floats)``: None becomes NaN where ``allow_none``, else refused.

    ``raw`` must be a sequence (a list, a tuple; a 1-D NumPy array or torch tensor, read with
    ``tolist``) of real numbers (``int``, ``float``, ``bool``, NumPy and torch scalars) or None.
    Anything else is refused by name, never iterated into scores: a dict's keys, a string's
    characters or a list of numeric strings would each read as numbers.

    Raises:
        ScorerFailed: ``raw`` is not such a sequence, holds what is not such a number, or holds
            None without ``allow_none``; ``where`` and the fix named.
    """
    if hasattr(raw, "tolist") and getattr(raw, "ndim", None) == 1:  # a NumPy array, a tensor
        raw = raw.tolist()
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes, bytearray)):
        raise ScorerFailed(
            f"{where}: the scorer returned {_kind(raw)}; it must return a list of one float per text "
            "(None for a text it does not score)"
        )
    raw = [_score(s) for s in raw]
    bad = [(i, s) for i, s in enumerate(raw) if s is not None and not isinstance(s, numbers.Real)]
    if bad:
        i, s = bad[0]
        raise ScorerFailed(
            f"{where}: the scorer returned {_kind(s)} ({shown(s, 60)}) for text {i}"
            + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
            + "; each score must be a number (int or float), or None for a text it does not score"
        )
    if not allow_none and any(s is None for s in raw):
        raise ScorerFailed(
            f"{where}: the scorer returned None for a sample; this call needs a score for every sample "
            "(None, 'does not apply', is taken where the samples are trained on or compared: an "
            "unscored sample leaves the statistics, as in TRL)"
        )
    return raw, [float("nan") if s is None else float(s) for s in raw]


def _validated(scores: list[float], raw: list, texts: list[str], where: str, allow_none: bool) -> list[float]:
    """``scores`` once checked: one per text, finite (NaN only for a None of ``allow_none``),
    within float32's range."""
    if len(scores) != len(texts):
        raise ScorerFailed(f"{where}: the scorer returned {len(scores)} scores for {len(texts)} texts")
    bad = [
        (t, s)
        for t, s, r in zip(texts, scores, raw)
        if not math.isfinite(s) and not (allow_none and r is None)
    ]
    if bad:
        listed = "; ".join(f"{s} for {t[:60]!r}" for t, s in bad[:3])
        raise ScorerFailed(f"{where}: the scorer returned non-finite scores: {listed}")
    # rewards are float32 tensors: a finite Python float above float32's max would become inf there
    big = [(t, s) for t, s in zip(texts, scores) if abs(s) > FLOAT32_MAX]
    if big:
        listed = "; ".join(f"{s} for {t[:60]!r}" for t, s in big[:3])
        raise ScorerFailed(
            f"{where}: the scorer returned scores beyond float32's range (+-{FLOAT32_MAX:.4g}), "
            f"which would be inf as rewards: {listed}"
        )
    return scores


def checked_scores(
    scorer: Scorer,
    texts: list[str],
    step: int | str,
    prompts=None,
    columns: dict[str, list] | None = None,
    *,
    allow_none: bool = False,
    completion_ids: Sequence[Sequence[int]] | None = None,
    state=None,
    reward_log: RewardLog | None = None,
    completions: list | None = None,
    env_replies: Sequence[Sequence[str]] | None = None,
) -> list[float]:
    """Call ``scorer`` as TRL calls a reward function (module docstring), and validate its
    output: one finite float per text.

    An ``async def`` scorer (or one that returns an awaitable) is awaited, as TRL 1.16 awaits
    async reward functions (PR #4567), on an event loop of its own
    (:func:`tether.models.turns.awaited`).

    Args:
        scorer: a plain scorer (called ``scorer(texts)``) or a TRL-style reward function
            (:func:`takes_prompts`, called with keywords); sync or ``async def``.
        texts: the B decoded responses (special tokens skipped, end token excluded).
        step: where the call happens, for messages: a training step number, or a phrase such as
            ``"held-out evaluation"``.
        prompts: B prompts as the dataset holds them (strings or conversations), or None.
        columns: the dataset columns, name -> B values.
        allow_none: a score may be None (TRL's marker of a sample the reward does not apply to:
            unscored); it comes back as NaN, for a caller that leaves it out of its statistics.
        completion_ids: B lists of token ids (the sampled response up to and including its first
            end token, no padding; multi-turn, the environment's tokens included), or None when
            the call has only texts (a function that needs them is then an error).
        state: the ``trainer_state`` (:func:`trainer_state`); None passes
            ``trainer_state(global_step=step)`` (step 0 for a phrase), ``max_steps=0``.
        reward_log: collects ``log_metric`` and ``log_extra`` calls; None drops them.
        completions: what a TRL-style function gets as ``completions`` when it is not
            :func:`trl_completions` of ``texts``: B message lists of a multi-turn rollout through
            the chat template (:attr:`tether.models.sampling.Rollout.messages`; ``texts`` are then
            their contents one per line), or None.
        env_replies: a multi-turn rollout's environment texts, B lists (:data:`ENV_REPLIES`),
            or None (a single-turn rollout: a function that needs them is then an error).

    Returns:
        B Python floats (NaN where a score was None and ``allow_none``).

    Raises:
        ScorerFailed: (a ``ValueError``) the scorer raised, or returned a wrong count, a NaN/inf
            score, one beyond float32's range, or a None without ``allow_none``; a missing argument
            (:class:`ArgumentError`'s message); the message names the step and the texts.
        ScorerStopped: the scorer raised ``SystemExit`` or ``KeyboardInterrupt``.
    """
    call = RewardCall(
        texts, step, prompts, columns, completion_ids, state, reward_log, completions, env_replies
    )
    return _scores(scorer, call, allow_none=allow_none).total


class Scores(NamedTuple):
    """What one scoring call gives: the scores and, for a reward list, each reward's part."""

    total: list[float]
    """B Python floats, the scores (a reward list: the weighted sums); NaN where unscored."""
    parts: dict[str, list[float]]
    """A reward list's rewards by name, each B values (NaN where that reward returned None), for
    ``reward/<name>``; {} for a single scorer."""


def _scores(scorer: Scorer, call: RewardCall, *, allow_none: bool) -> Scores:
    """:func:`checked_scores` with a reward list's parts: the one call and check of a scorer."""
    from tether.models.turns import awaited

    with _reported(call.where, len(call.texts), scorer):
        raw = awaited(_call(scorer.scored if isinstance(scorer, WeightedReward) else scorer, call))
    parts = raw.parts if isinstance(raw, Scores) else {}
    if isinstance(raw, Scores):  # a reward list's: its unscored sums are TRL's None
        raw = [None if math.isnan(x) else x for x in raw.total]
    raw, scores = _floats(raw, allow_none, call.where)
    return Scores(_validated(scores, raw, call.texts, call.where, allow_none), parts)


def score_rollout(
    scorer: Scorer,
    rollout: Rollout,
    where: int | str,
    *,
    state=None,
    reward_log: RewardLog | None = None,
    allow_none: bool = True,
) -> Scores:
    """Score a rollout as TRL scores a batch of completions: the one place a
    :class:`tether.models.sampling.Rollout` becomes TRL's keywords (module docstring): its
    ``responses`` as the texts, ``prompts``, ``columns``, ``completion_ids``, ``messages`` (a
    multi-turn chat rollout's ``completions``) and ``env_texts`` (``env_replies``).

    Args:
        scorer: a plain scorer, a TRL-style reward function, or a reward list
            (:class:`WeightedReward`, whose parts come back in :attr:`Scores.parts`).
        rollout: the samples, with their ``columns`` (the rows' dataset columns) set.
        where: a training step, or a phrase for messages (:func:`checked_scores`' ``step``).
        state: the ``trainer_state``; reward_log: collects ``log_metric`` / ``log_extra``.
        allow_none: None is an unscored sample (NaN; TRL's "unscorable"), as where the samples
            are trained on or compared; False refuses it.

    Returns:
        :class:`Scores`.

    Raises:
        as :func:`checked_scores`.
    """
    call = RewardCall(
        rollout.responses,
        where,
        prompts=rollout.prompts,
        # environment_factory's objects: TRL's `environments` keyword, passed as a column is
        columns=rollout.columns
        if rollout.environments is None
        else {**(rollout.columns or {}), ENVIRONMENTS: list(rollout.environments)},
        completion_ids=rollout.completion_ids,
        state=state,
        reward_log=reward_log,
        completions=rollout.messages,
        env_replies=rollout.env_texts,
    )
    return _scores(scorer, call, allow_none=allow_none)


class WeightedReward:
    """Several reward functions as one: ``sum_i w_i * r_i`` per sample (``reward.scorer`` a list,
    ``reward.weights``), a TRL-style reward function itself.

    A function may return None for a sample it does not apply to (TRL's convention): that sample
    is left out of that reward, i.e. the sum skips it (NaN-sum, as TRL does). A sample no function
    scores is unscored: its sum is None, and the trainers leave it out of every statistic (GRPO's
    and RLOO's group baselines, with advantage 0; PPO's update), as TRL 1.16 does (PR #5902).
    ``async def`` functions are awaited together, concurrently, as TRL runs its async rewards.
    :meth:`scored` returns every reward's values with the sums (:class:`Scores`), for
    ``reward/<name>``; calling the list returns the sums alone, as a TRL reward function does.

    Args:
        scorers: name -> scorer, in order.
        weights: one per scorer (default all 1).

    Raises:
        ValueError: as many weights as scorers are needed, each finite.
    """

    def __init__(self, scorers: dict[str, Scorer], weights: Sequence[float] | None = None):
        self.scorers = dict(scorers)
        self.weights = [1.0] * len(self.scorers) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.scorers) or not all(math.isfinite(w) for w in self.weights):
            raise ValueError(
                f"reward.weights={shown(list(weights or []))}: give one finite weight per reward.scorer "
                f"({len(self.scorers)}: {list(self.scorers)})"
            )

    def __call__(
        self,
        prompts=None,
        completions: list | None = None,
        completion_ids: list[list[int]] | None = None,
        trainer_state=None,
        log_extra: Callable | None = None,
        *,
        log_metric: Callable | None = None,
        env_replies: Sequence[Sequence[str]] | None = None,
        **columns,
    ) -> list[float | None]:
        """TRL's call (module docstring, :meth:`scored`): B floats, the weighted sums; None for a
        sample every reward returned None for."""
        out = self.scored(
            prompts,
            completions,
            completion_ids,
            trainer_state,
            log_extra,
            log_metric=log_metric,
            env_replies=env_replies,
            **columns,
        )
        return [None if math.isnan(x) else x for x in out.total]

    def scored(
        self,
        prompts=None,
        completions: list | None = None,
        completion_ids: list[list[int]] | None = None,
        trainer_state=None,
        log_extra: Callable | None = None,
        *,
        log_metric: Callable | None = None,
        env_replies: Sequence[Sequence[str]] | None = None,
        **columns,
    ) -> Scores:
        """TRL's call (module docstring); each reward gets what it names of it (``env_replies``
        too, named here so that it reaches the rewards that name it).

        Returns:
            :class:`Scores`: B weighted sums (NaN for a sample every reward returned None for) and
            each reward's values by name (NaN where it returned None).
        """
        from tether.models.turns import awaited

        texts = completion_texts(completions or [])
        logged = RewardLog()
        raws = {}
        call = RewardCall(
            texts,
            "",
            prompts=prompts,
            columns=columns,
            completion_ids=completion_ids,
            state=trainer_state,
            reward_log=logged,
            completions=completions,
            env_replies=env_replies,
        )
        try:
            for name, scorer in self.scorers.items():
                with _reported(f"reward {shown(name)}", len(texts), scorer):
                    raws[name] = _call(scorer, call._replace(step=f"reward {shown(name)}"))
        except BaseException:  # the async rewards called before it will not be awaited: closed
            for raw in raws.values():
                if inspect.iscoroutine(raw):
                    raw.close()
            raise
        pending = [name for name, raw in raws.items() if inspect.isawaitable(raw)]
        if pending:  # every async reward at once, on one loop (TRL: asyncio.gather)

            async def together():
                return await asyncio.gather(*(raws[n] for n in pending), return_exceptions=True)

            with _reported(f"rewards {shown(pending)}", len(texts), self):
                done = awaited(together())
            for name, result in zip(pending, done):
                if isinstance(result, BaseException):
                    with _reported(f"reward {shown(name)}", len(texts), self.scorers[name]):
                        raise result
                raws[name] = result
        parts = {}
        for name, raw in raws.items():
            where = f"reward {shown(name)}"
            raw, scores = _floats(raw, True, where)
            parts[name] = _validated(scores, raw, texts, where, allow_none=True)
        logged.replay(log_metric, log_extra)
        total: list[float] = []
        for i in range(len(texts)):
            terms = [w * v[i] for w, v in zip(self.weights, parts.values()) if not math.isnan(v[i])]
            total.append(sum(terms) if terms else math.nan)  # NaN: unscored, as TRL's NaN row
        return Scores(total, parts)
