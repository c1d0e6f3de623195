"""One sampler per run, chosen once: how a batch of prompts becomes a :class:`Rollout`.

A run builds its sampler at set-up (:func:`tether.run.setup.build_run`, ``Run.sampler``) from its
settings (:class:`SamplingSettings`, one frozen record of ``rollout.*``) and its environment, and
every stage that samples calls it: the trainers' rollouts (``sample_policy``), the held-out
evaluation, DPO's pairs and KL probe, the frontier's best-of-N (``sample``). Nothing else calls
:func:`tether.models.sampling.generate` or :func:`tether.models.turns.generate_turns`, so the
choice between one turn and tool turns is made here, once, by name (:data:`SAMPLERS`), as verl
registers its agent loops (``@register("tool_agent")``); the trainer only ever sees the
:class:`Rollout` (its ``response_mask``, ``env_mask``, ``seeds``).

Two kinds (:data:`RolloutKind`):

* ``one_turn`` (:class:`OneTurn`): one response per prompt, ended at an end id or the length cap
  (:func:`tether.models.sampling.generate`); it also holds ``rollout.compile``'s decision
  (:class:`CompileChoice`), taken after the first rollout it samples for training.
* ``tool_turns`` (:class:`ToolTurns`): policy turns and an environment's answers
  (``rollout.env``, :func:`tether.models.turns.generate_turns`), decoded eagerly.

A new kind is a subclass of :class:`Sampler` registered with ``@register("name")`` (its name in
:data:`RolloutKind`) and picked by :func:`rollout_kind` (docs/architecture.md, "How to add ... a
rollout kind").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from typing import ClassVar, Literal

import torch
from torch import nn

from tether.core import distributed as D
from tether.models.policy import PolicyWithValue
from tether.models.sampling import (
    COMPILE_COST_S,
    Rollout,
    SamplingSettings,
    can_compile,
    compile_repays,
    compile_saving,
    compiled_mismatch,
    generate,
)
from tether.models.sharding import generation_weights, is_sharded
from tether.models.turns import EnvFn, generate_turns

RolloutKind = Literal["one_turn", "tool_turns"]
"""The registered kinds of sampler (:data:`SAMPLERS`)."""


class SamplerCopy:
    """A bfloat16 copy of the policy's LM that the training rollouts decode on (``rollout.dtype=bf16``).

    Built from the policy at the first training rollout (after any resume has loaded its weights)
    and refreshed before every one after: the tensors the run trains (``requires_grad``: the
    trained blocks, a LoRA adapter's matrices, applied in bfloat16 as peft applies them) are
    copied over, rounded to bfloat16; the frozen ones were rounded once. So the copy is always
    the policy of the step, rounded (a resumed run's too, rebuilt from the checkpoint's weights),
    and no state of its own is saved. Buffers keep their dtype (rotary frequencies stay float32:
    rounding them would change every position's angle, not only the weights). A tied input and
    output embedding stays one tensor.
    """

    def __init__(self) -> None:
        self.lm: nn.Module | None = None
        self.trained: list[tuple[nn.Parameter, nn.Parameter]] = []
        """(the policy's parameter, the copy's) for each trained tensor."""

    @torch.no_grad()
    def of(self, lm: nn.Module) -> nn.Module:
        """The copy of ``lm`` as it is now, built on the first call, refreshed on each later one."""
        if self.lm is None:
            self.lm, self.trained = self.build(lm)
        else:
            for source, target in self.trained:
                target.copy_(source)  # rounds to bfloat16
        return self.lm

    @staticmethod
    def build(lm: nn.Module) -> tuple[nn.Module, list[tuple[nn.Parameter, nn.Parameter]]]:
        """A deep copy of ``lm`` with every floating-point parameter bfloat16, in eval mode, and
        the pairs of trained tensors."""
        copy = deepcopy(lm).eval()
        rounded: dict[int, nn.Parameter] = {}  # id of the copy's fp32 parameter -> its bf16 one
        for module in copy.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_floating_point():
                    continue
                if id(p) not in rounded:  # a tied tensor is rounded once and shared again
                    rounded[id(p)] = nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
                module._parameters[name] = rounded[id(p)]
        named = dict(copy.named_parameters(remove_duplicate=False))
        pairs = [
            (p, named[name])
            for name, p in lm.named_parameters(remove_duplicate=True)
            if p.requires_grad and name in named
        ]
        return copy, pairs


class Sampler:
    """Samples responses to prompts: a registered kind (:data:`SAMPLERS`), built once per run.

    Args:
        tokenizer: the run's tokenizer.
        settings: the run's :class:`SamplingSettings`.
        env: the environment of tool turns (:data:`tether.models.turns.EnvFn`), or None.
        device: the device of the policy's weights (where the compile check's numbers live).
    """

    kind: ClassVar[str]
    compiles: ClassVar[bool] = False
    """Whether the kind decodes compiled where ``rollout.compile`` asks (one turn does); a kind
    that does not is refused ``rollout.compile=true`` (:func:`make_sampler`)."""

    def __init__(self, tokenizer, settings: SamplingSettings, env: EnvFn | None = None, *, device="cpu"):
        self.tokenizer, self.settings, self.env = tokenizer, settings, env
        self.device = torch.device(device)
        self.copy = SamplerCopy() if settings.dtype == "bf16" else None
        """``rollout.dtype=bf16``: the training rollouts' bfloat16 copy of the policy's LM."""

    def rollout_lm(self, policy: PolicyWithValue) -> nn.Module:
        """The LM a training rollout decodes on: the policy's own, or with ``rollout.dtype=bf16``
        its bfloat16 copy, refreshed to the policy's weights now (:class:`SamplerCopy`)."""
        return self.copy.of(policy.lm) if self.copy is not None else policy.lm

    def on_copy(self, lm: nn.Module) -> bool:
        """Whether ``lm`` is this sampler's bfloat16 copy (``Rollout.sampler_dtype``)."""
        return self.copy is not None and lm is self.copy.lm

    def sample(
        self,
        lm: nn.Module,
        prompts: Sequence,
        seeds: Sequence[int] | None,
        *,
        weights: nn.Module | None = None,
        share_prefix: bool = False,
    ) -> Rollout:
        """One response per prompt from ``lm`` (with tool turns, an episode), decoded eagerly.

        Args:
            lm: the causal LM to sample (the policy's, the frozen reference).
            prompts: B texts or conversations; a :class:`tether.data.prompts.PromptData` passes
                its rows' other columns along (to the environment, and as ``Rollout.columns``).
            seeds: B sample seeds (:func:`tether.models.sampling.sample_seeds`); row ``b``'s
                sample depends on ``seeds[b]`` alone. None (one turn only): drawn from torch's
                global generator.
            weights: the FSDP-sharded module that holds ``lm``'s weights, gathered for the call
                as ``sharded_generation`` says (every process must call); None where they are
                whole or already gathered (rank 0 evaluating alone).
            share_prefix: rows of a group share one prompt: run it once
                (:func:`tether.models.sampling.generate`; a kind may ignore it).

        Returns:
            The :class:`Rollout`, ``seeds`` and ``columns`` filled.
        """
        raise NotImplementedError

    def sample_policy(self, policy: PolicyWithValue, prompts: Sequence, seeds: Sequence[int]) -> Rollout:
        """A training step's rollout from the policy being trained: its LM, its weights gathered
        for the call (FSDP), its prompt sharing (``model.share_prompt_prefix`` in groups); decoded
        as :meth:`choose_decoding` decided (``Rollout.compiled``)."""
        return self.sample(
            self.rollout_lm(policy), prompts, seeds, weights=policy, share_prefix=policy.share_prefix
        )

    def choose_decoding(
        self, policy: PolicyWithValue, rollout: Rollout, *, step: int, steps: int, generate_s: float
    ) -> Iterator[str]:
        """After a training rollout of ``policy`` (step ``step`` of ``steps``, sampled in
        ``generate_s`` seconds): decide how the later ones decode (``rollout.compile``). Yields
        the lines to print as it goes; nothing here (a kind that decodes one way only)."""
        return iter(())


SAMPLERS: dict[str, type[Sampler]] = {}
"""Kind name -> sampler class, filled by :func:`register` where each class is written."""


def register(kind: str) -> Callable[[type[Sampler]], type[Sampler]]:
    """Class decorator: register a :class:`Sampler` under ``kind`` (its name in
    :data:`RolloutKind`), as verl's ``@register("tool_agent")`` registers an agent loop.

    Raises:
        ValueError: ``kind`` is registered already.
    """

    def add(cls: type[Sampler]) -> type[Sampler]:
        if kind in SAMPLERS:
            raise ValueError(f"rollout kind {kind!r} is registered already ({SAMPLERS[kind].__name__})")
        cls.kind = kind
        SAMPLERS[kind] = cls
        return cls

    return add


def rollout_kind(env: EnvFn | None) -> RolloutKind:
    """The kind a run samples with: ``tool_turns`` with an environment (``rollout.env``), else
    ``one_turn``."""
    return "tool_turns" if env is not None else "one_turn"


def make_sampler(tokenizer, settings: SamplingSettings, env: EnvFn | None = None, *, device="cpu") -> Sampler:
    """The run's sampler: the :data:`SAMPLERS` entry :func:`rollout_kind` names, built once.

    Raises:
        ValueError: ``rollout.compile=true`` where decoding cannot be compiled (:class:`CompileChoice`),
            or with a kind that decodes eagerly (:attr:`Sampler.compiles`).
    """
    kind = rollout_kind(env)
    cls = SAMPLERS[kind]
    if settings.compile is True and not cls.compiles:
        raise ValueError(
            f"rollout.compile=true: the {kind} rollouts decode eagerly; use rollout.compile=auto or false"
        )
    return cls(tokenizer, settings, env, device=device)


class CompileChoice:
    """``rollout.compile`` for a run's training rollouts: eager until decided, decided once,
    after the first rollout sampled (by each process, a resumed one included; :meth:`decide`).

    Args:
        setting: True, False or ``"auto"`` (:attr:`SamplingSettings.compile`).
        device: the policy's device. ``auto`` is decided only on a CPU, where the saving
            (:data:`tether.models.sampling.COMPILE_SAVINGS`) and the compile's cost were measured.

    Attributes:
        pending: the decision is still to be taken, after the next training rollout.
        compiled: the training rollouts decode compiled.

    Raises:
        ValueError: ``setting`` True and decoding cannot be compiled here
            (:func:`tether.models.sampling.can_compile`: the reason and the fix named).
    """

    def __init__(self, setting: bool | Literal["auto"], device: torch.device):
        self.setting, self.device, self.compiled = setting, device, False
        why = can_compile(device) if setting is not False else None
        if setting is True and why:
            raise ValueError(f"rollout.compile=true: {why}; install one or use rollout.compile=false")
        self.pending = bool(setting) and not (setting == "auto" and (why or device.type != "cpu"))

    def decide(
        self, rollout: Rollout, *, step: int, steps: int, generate_s: float, again: Callable[[], Rollout]
    ) -> Iterator[str]:
        """Whether the later training rollouts decode compiled, after ``rollout``, the first
        (decoded eagerly in ``generate_s`` seconds at step ``step`` of ``steps``). Yields the
        lines to print as it goes: ``auto``'s verdict before the seconds of compiling.

        ``auto`` wants it where the steps left repay the compile
        (:func:`tether.models.sampling.compile_repays`, on the slowest process's ``generate_s``,
        so that every process decides alike); ``true`` always. Either way the rollout is then
        sampled again compiled (``again()``, the same prompts and seeds) and must reproduce the
        eager one (:func:`tether.models.sampling.compiled_mismatch`) on every process, or
        ``auto`` stays eager and ``true`` stops: a kernel that computes another distribution is
        caught here, not trained on.

        Raises:
            RuntimeError: ``rollout.compile=true`` and the compiled decode does not reproduce the
                eager one (the reason is named).
        """
        self.pending = False
        left = steps - step - 1
        rows = len(rollout.prompts)
        wanted = self.setting is True
        if not wanted:
            slowest = float(
                D.all_reduce_max(torch.tensor(generate_s, dtype=torch.float64, device=self.device))
            )
            wanted = compile_repays(slowest, left, rows)
            if left > 0:
                verdict = "compiling the decode step" if wanted else "eager decoding"
                yield (
                    f"tether: rollout.compile=auto: {verdict} "
                    f"({left} step(s) left x {slowest:.2f} s generate x {compile_saving(rows):.0%} saved at "
                    f"{rows} rows = {left * slowest * compile_saving(rows):.0f} s, against "
                    f"~{COMPILE_COST_S:.0f} s of compiling)"
                )
        if not wanted or left == 0:
            return
        why = compiled_mismatch(rollout, again())
        failed = float(D.all_reduce_max(torch.tensor(float(why is not None), device=self.device)))
        if failed and self.setting is True:
            raise RuntimeError(
                f"rollout.compile=true: the compiled decode of step {step}'s rollout does not reproduce "
                f"the eager one ({why or 'on another process'}); torch.compile computes another "
                "distribution on this machine: use rollout.compile=false"
            )
        if failed:
            yield (
                f"tether: rollout.compile=auto: eager decoding after all: the compiled decode of step "
                f"{step}'s rollout does not reproduce the eager one ({why or 'on another process'})"
            )
        self.compiled = not failed


@register("one_turn")
class OneTurn(Sampler):
    """One response per prompt (:func:`tether.models.sampling.generate`); the training rollouts
    decoded compiled once :class:`CompileChoice` decided so."""

    compiles: ClassVar[bool] = True

    def __init__(self, tokenizer, settings: SamplingSettings, env: EnvFn | None = None, *, device="cpu"):
        super().__init__(tokenizer, settings, env, device=device)
        self.compile = CompileChoice(settings.compile, self.device)

    def sample(self, lm, prompts, seeds, *, weights=None, share_prefix=False) -> Rollout:
        return self.decode(lm, prompts, seeds, weights=weights, share_prefix=share_prefix, compiled=False)

    def sample_policy(self, policy, prompts, seeds) -> Rollout:
        return self.decode(
            self.rollout_lm(policy),
            prompts,
            seeds,
            weights=policy,
            share_prefix=policy.share_prefix,
            compiled=self.compile.compiled,
        )

    def choose_decoding(self, policy, rollout, *, step, steps, generate_s) -> Iterator[str]:
        if not self.compile.pending:
            return iter(())
        return self.compile.decide(
            rollout,
            step=step,
            steps=steps,
            generate_s=generate_s,
            again=lambda: self.decode(
                self.rollout_lm(policy),
                rollout.prompts,
                rollout.seeds,
                weights=policy,
                share_prefix=policy.share_prefix,
                compiled=True,
            ),
        )

    def decode(
        self,
        lm: nn.Module,
        prompts: Sequence,
        seeds: Sequence[int] | None,
        *,
        weights: nn.Module | None,
        share_prefix: bool,
        compiled: bool,
    ) -> Rollout:
        """:func:`tether.models.sampling.generate` with the run's settings, on ``weights``
        gathered as ``sharded_generation`` says; ``compiled``: its compiled decode step."""
        s = self.settings
        with generation_weights(weights, s.sharded_generation) as synced:  # FSDP
            rollout = generate(
                lm,
                self.tokenizer,
                prompts=list(prompts),
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                max_prompt_tokens=s.max_prompt_tokens,
                seeds=seeds,
                share_prefix=share_prefix,
                synced=synced,
                compiled=compiled,
                keep_logits=self.on_copy(lm),
            )
        rollout.columns = getattr(prompts, "columns", None)
        rollout.sampler_dtype = "bf16" if self.on_copy(lm) else "fp32"
        return rollout


@register("tool_turns")
class ToolTurns(Sampler):
    """Policy turns and the environment's answers (:func:`tether.models.turns.generate_turns`),
    decoded eagerly, prompts not shared.

    Raises:
        ValueError: no environment.
    """

    def __init__(self, tokenizer, settings: SamplingSettings, env: EnvFn | None = None, *, device="cpu"):
        if env is None:
            raise ValueError("tool turns need an environment (rollout.env)")
        super().__init__(tokenizer, settings, env, device=device)

    def sample(self, lm, prompts, seeds, *, weights=None, share_prefix=False) -> Rollout:
        """:meth:`Sampler.sample`; ``share_prefix`` is ignored.

        Raises:
            ValueError: ``seeds`` None; sharded ``weights`` (tool turns are not built for FSDP:
                ``train.sharding=fsdp`` refuses ``rollout.env``).
            EnvFailed, EnvReplyError: as :func:`tether.models.turns.generate_turns`.
        """
        if seeds is None:
            raise ValueError("tool turns need a seed per row")
        if is_sharded(weights):
            raise ValueError("multi-turn rollouts are not built for train.sharding=fsdp")
        columns = getattr(prompts, "columns", None)
        rollout = generate_turns(
            lm, self.tokenizer, list(prompts), self.env, settings=self.settings, seeds=seeds, columns=columns
        )
        rollout.columns = columns
        rollout.sampler_dtype = "bf16" if self.on_copy(lm) else "fp32"
        return rollout
