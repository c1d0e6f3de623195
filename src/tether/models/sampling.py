"""Rollouts: tokenize prompts, sample responses, score them with policy and reference.

This is the only math-adjacent module that talks to models. Everything it returns is a tensor
whose shape is written beside it; masks follow the glossary (``response_mask`` True = counts).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from transformers import (
    CompileConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tether.core.logprobs import logprobs_from_logits, response_mask_from_tokens
from tether.core.noise import gumbel_noise
from tether.models import (
    head,  # head.prefix_cache and head.shares_prefix looked up at call time
)
from tether.models.head import (
    cache_argument,
    position_ids_from_mask,
)
from tether.models.lora import AdapterReference

EnvFormat = Literal["auto", "chat", "raw"]
"""How an environment's text joins a tool-turn response (``rollout.env_format``,
:mod:`tether.models.turns`)."""


@dataclass(frozen=True)
class SamplingSettings:
    """How a run samples, fixed for the run (built once from ``rollout.*`` by
    :func:`tether.run.setup.sampling_settings`): what its sampler
    (:class:`tether.models.rollouts.Sampler`) and the tool-turn loop
    (:func:`tether.models.turns.generate_turns`) read.

    Attributes:
        max_new_tokens: response tokens at most (with tool turns, the policy's and the
            environment's together).
        temperature: sampling temperature (> 0); every log-probability uses the same.
        max_prompt_tokens: the longest prompt accepted, tokens (None: not checked; the static
            cache of compiled decoding then spans the batch's longest).
        stop_strings: texts that end a policy turn (tool turns).
        max_turns: policy turns at most (tool turns).
        env_format: how the environment's text joins the response (``raw``, ``chat``, ``auto``).
        env_timeout: seconds one environment call may take, None for no limit.
        sharded_generation: how an FSDP-sharded model's weights are gathered for sampling
            (``train.sharded_generation``: ``blocks`` or ``whole``,
            :func:`tether.models.sharding.generation_weights`).
        compile: ``rollout.compile`` as the run uses it for its training rollouts: True, False,
            or ``"auto"`` (False where compiled decoding is not built for the run: DPO, LoRA,
            FSDP).
    """

    max_new_tokens: int
    temperature: float
    max_prompt_tokens: int | None = None
    stop_strings: tuple[str, ...] = ()
    max_turns: int = 1
    env_format: EnvFormat = "auto"
    env_timeout: float | None = None
    sharded_generation: Literal["blocks", "whole"] = "blocks"
    compile: bool | Literal["auto"] = False
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The precision the training rollouts decode in (``rollout.dtype`` resolved): ``bf16`` on a
    bfloat16 copy of the policy's weights (:class:`tether.models.rollouts.SamplerCopy`), ``fp32``
    on the learner itself."""


SAMPLER_LOGITS_BYTES = 512 << 20
"""The most memory (512 MiB per process) a low-precision rollout spends keeping the sampler's
logits (B x max_new_tokens x V, bfloat16) for ``rollout/sampler_kl_exact``; the demo's 16 rows of
16 tokens over SmolLM2's 49,152 ids take 25 MB. Past it the exact sampler KL is not measured
(the log-prob metrics and the correction still are)."""


@dataclass
class Rollout:
    """One batch of prompts and sampled responses.

    Attributes:
        prompts: B prompt strings.
        prompt_ids: (B, P) long, left-padded.
        prompt_mask: (B, P) long, 0 on padding.
        response_ids: (B, R) long; slots after the response (its first EOS, or a multi-turn
            episode's end) hold the pad token.
        response_mask: (B, R) bool, True on the tokens the policy sampled: up to and including
            the first EOS (a prefix of the row); multi-turn, False also on the environment's
            tokens between the policy's turns (``env_mask``), a mask with holes.
        responses: B decoded responses (up to, not including, EOS); multi-turn, the whole
            transcript, the environment's text included.
        ended: (B,) bool, True where the response ended with EOS (not cut at the length cap);
            multi-turn, where the episode ended on its own (an end id, or the environment's
            None), not at a limit (:func:`tether.models.turns.generate_turns`).
        sampler_logprobs: (B, R) float32, the log-probability (nats) of each response token under
            the distribution the sampler drew it from (the decoding pass's logits, key/value
            cached), or None when the responses were not sampled here. Compared with the
            learner's log-probs of the same tokens in ``rollout/logprob_mismatch``.

    Every tensor lives on the device of the model that made or will score the rollout.
    """

    prompts: list[str]
    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    responses: list[str]
    ended: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    columns: dict[str, list] | None = None
    """The prompts' rows' other dataset columns, one value per row (``data.prompts``), or None."""
    env_mask: Tensor | None = None
    """(B, R) bool, True on the response tokens an environment wrote (a multi-turn rollout,
    :func:`tether.models.turns.generate_turns`; ``response_mask`` is False there), or None (every
    response token is the policy's or padding)."""
    env_texts: list[list[str]] | None = None
    """Per row, the texts the environment appended, in order (what samples.jsonl shows), or None."""
    env_offsets: list[list[int] | None] | None = None
    """Per row, where each of ``env_texts`` starts in ``responses`` (character offsets), so that a
    reader marks the environment's text and not the same text the policy wrote elsewhere; None
    for a row where they are not known (a chat row: its ``messages`` tell), or no environment."""
    policy_texts: list[str] | None = None
    """Per row, the policy's own text (its turns without the environment's), or None (one turn:
    ``responses`` is the policy's). What the diversity and fluency metrics read
    (:attr:`own_texts`)."""
    messages: list[list[dict]] | None = None
    """Per row, a multi-turn response through the chat template as messages, TRL's
    ``completions`` of a tool-calling run: ``[{"role": "assistant", "content": ...}, {"role":
    "tool", "content": ...}, ...]``, or None (the reward then gets ``responses``)."""
    seeds: list[int] | None = None
    """Per row, the sample seed it was drawn with (:func:`sample_seeds`; a multi-turn row's turns
    are keyed from it), so that a later stage can sample the same rows again (the compile check,
    :class:`tether.models.rollouts.CompileChoice`); None where the responses were not sampled here."""
    tool_calls: list[int] | None = None
    """Per row, the tool calls run in a tool-calling rollout (``rollout.tools``), or None."""
    tool_failures: list[int] | None = None
    """Per row, how many of ``tool_calls`` failed (raised, named no tool), or None."""
    environments: list | None = None
    """Per row, its environment object (``environment_factory``, TRL's ``environments``), as the
    rollout left it, or None."""
    sampler_logits: Tensor | None = None
    """(B, R, V) bfloat16: the sampler's logits at each response position, where the sampler is a
    low-precision copy (``rollout.dtype=bf16``; its logits are bfloat16 numbers, kept exactly)
    and they fit :data:`SAMPLER_LOGITS_BYTES`, else None. With the learner's logits they give the
    exact ``KL(sampler || learner)`` per position (``rollout/sampler_kl_exact``)."""
    sampler_dtype: str = "fp32"
    """``bf16`` where the responses were decoded on the sampler's bfloat16 copy of the policy
    (``rollout.dtype=bf16``, :class:`tether.models.rollouts.SamplerCopy`): the sampler is then not
    the learner. ``fp32``: the model that scores them sampled them (in whatever ``model.dtype``)."""
    compiled: bool = False
    """Whether the responses were decoded by the compiled decode step (``rollout.compile``,
    :func:`generate`'s ``compiled``): the ``rollout/compiled`` metric."""

    @property
    def own_texts(self) -> list[str]:
        """B texts the policy wrote: ``policy_texts`` in a multi-turn rollout, else ``responses``."""
        return self.policy_texts if self.policy_texts is not None else self.responses

    def turn_metrics(self) -> dict[str, Tensor]:
        """Per-row numbers of a multi-turn rollout, by metric name: ``env_tokens``, (B,) float, the
        tokens the environment wrote in each response, and in a tool-calling one ``tool_calls``
        and ``tool_failures``, the calls run and failed; {} for a one-turn rollout."""
        if self.env_mask is None:
            return {}
        out = {"env_tokens": self.env_mask.sum(-1).float()}
        if self.tool_calls is not None and self.tool_failures is not None:
            device = self.env_mask.device
            out["tool_calls"] = torch.tensor(self.tool_calls, dtype=torch.float32, device=device)
            out["tool_failures"] = torch.tensor(self.tool_failures, dtype=torch.float32, device=device)
        return out

    def turn_row(self, i: int) -> dict:
        """What row ``i``'s record (samples.jsonl, the report) holds of its turns: ``env`` (the
        environment's texts, in order), ``env_at`` (where each starts in ``responses[i]``, when
        known), ``policy_tokens`` and ``env_tokens``, ``ended`` (False: cut at a limit, not ended on
        its own), then ``messages`` (through the chat template: the reward's completions); {} for
        a one-turn row without messages."""
        row: dict = {}
        if self.env_texts is not None:  # a multi-turn rollout: what the environment wrote
            row["env"] = self.env_texts[i]
            at = self.env_offsets[i] if self.env_offsets is not None else None
            if at is not None:
                row["env_at"] = at
            row["policy_tokens"] = int(self.response_mask[i].sum())
            row["env_tokens"] = int(self.env_mask[i].sum()) if self.env_mask is not None else 0
            row["ended"] = bool(self.ended[i]) if self.ended is not None else None
        if self.messages is not None:
            row["messages"] = self.messages[i]
        return row

    @property
    def completion_ids(self) -> list[list[int]]:
        """B lists of token ids: each response's tokens where ``response_mask`` is True (up to and
        including the first end token, no padding), and in a multi-turn rollout the environment's
        tokens between them (the whole transcript), on the host. What TRL 1.16 passes reward
        functions as ``completion_ids`` (its ``completion_ids_list``)."""
        mask = self.response_mask if self.env_mask is None else self.response_mask | self.env_mask
        ids, mask = self.response_ids.cpu(), mask.cpu()  # (B, R) each
        return [row[m].tolist() for row, m in zip(ids, mask)]

    @property
    def input_ids(self) -> Tensor:
        """(B, P + R - 1): prompt and response without its last token (it predicts nothing)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)[:, :-1]

    @property
    def attention_mask(self) -> Tensor:
        """(B, P + R - 1): prompt padding masked; response slots all attend (a post-EOS slot
        comes after every valid token, so causal attention keeps it out of their logits)."""
        ones = torch.ones_like(self.response_ids)
        return torch.cat([self.prompt_mask, ones], dim=1)[:, :-1]

    def select(self, idx: Tensor) -> Rollout:
        """Rows ``idx`` of this rollout (for minibatches)."""
        rows = idx.tolist()
        return Rollout(
            prompts=[self.prompts[i] for i in rows],
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            responses=[self.responses[i] for i in rows],
            ended=self.ended[idx] if self.ended is not None else None,
            sampler_logprobs=self.sampler_logprobs[idx] if self.sampler_logprobs is not None else None,
            columns={k: [v[i] for i in rows] for k, v in self.columns.items()} if self.columns else None,
            env_mask=self.env_mask[idx] if self.env_mask is not None else None,
            env_texts=[self.env_texts[i] for i in rows] if self.env_texts is not None else None,
            env_offsets=[self.env_offsets[i] for i in rows] if self.env_offsets is not None else None,
            policy_texts=[self.policy_texts[i] for i in rows] if self.policy_texts is not None else None,
            messages=[self.messages[i] for i in rows] if self.messages is not None else None,
            seeds=[self.seeds[i] for i in rows] if self.seeds is not None else None,
            sampler_logits=self.sampler_logits[idx] if self.sampler_logits is not None else None,
            sampler_dtype=self.sampler_dtype,
            compiled=self.compiled,
        )


CHAT_TEMPLATE_FLAG = "tether_chat_template"
"""Attribute set on a tokenizer by :func:`use_chat_template` (``data.chat_template``)."""


TEMPLATE_KWARGS = "tether_chat_template_kwargs"
"""Attribute set on a tokenizer by :func:`set_template_kwargs` (``data.chat_template_kwargs``)."""


def set_template_kwargs(tokenizer, kwargs: dict) -> None:
    """Make every :func:`render_chat` with ``tokenizer`` pass ``kwargs`` (the chat template's
    extra variables, ``data.chat_template_kwargs``) to ``apply_chat_template``."""
    setattr(tokenizer, TEMPLATE_KWARGS, dict(kwargs))


class RowPrompt(list):
    """A conversation with template variables of its own row (TRL's per-row ``tools`` and
    ``chat_template_kwargs`` columns of a preference dataset): a list of messages as any
    conversational prompt, whose ``template_kwargs`` every rendering of it adds
    (:func:`render_chat`, :func:`prompt_texts`)."""

    def __init__(self, messages, template_kwargs: dict | None = None):
        super().__init__(messages)
        self.template_kwargs = dict(template_kwargs or {})


def render_chat(tokenizer, messages: list, *, add_generation_prompt: bool, **kwargs) -> str:
    """``messages`` rendered as text by ``tokenizer``'s chat template, with the template
    variables :func:`set_template_kwargs` gave it and those of the row (:class:`RowPrompt`): the
    one place tether applies a chat template."""
    extra = {**getattr(tokenizer, TEMPLATE_KWARGS, {}), **getattr(messages, "template_kwargs", {}), **kwargs}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def use_chat_template(tokenizer) -> None:
    """Make every prompt tether tokenizes with ``tokenizer`` one user message formatted by the
    tokenizer's chat template (:func:`prompt_texts`).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.chat_template=true: the tokenizer of model.name has no chat template "
            "(tokenizer_config.json or chat_template.jinja); use a chat model or data.chat_template=false"
        )
    setattr(tokenizer, CHAT_TEMPLATE_FLAG, True)


def prompt_texts(tokenizer, prompts: Sequence) -> list[str]:
    """The text tether tokenizes for each prompt.

    A conversation (a list of ``{"role", "content"}`` messages, system prompts kept) is rendered
    by the tokenizer's chat template with the assistant's turn opened (``add_generation_prompt``).
    A text is itself, or with :func:`use_chat_template` the chat template applied to
    ``[{"role": "user", "content": prompt}]``, what a chat model was tuned on. A BOS token the
    template writes is dropped when the tokenizer adds its own (no double BOS).

    Raises:
        ValueError: a conversation, and the tokenizer has no chat template.
    """
    chat = getattr(tokenizer, CHAT_TEMPLATE_FLAG, False)
    if not chat and all(isinstance(p, str) for p in prompts):
        return list(prompts)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the prompts (data.prompts, data.eval_prompts) hold conversations (lists of {role, content} "
            "messages), and the tokenizer of "
            "model.name has no chat template to render them; use a chat model or text prompts"
        )
    texts = []
    for p in prompts:
        if isinstance(p, str) and not chat:
            texts.append(p)
            continue
        messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
        texts.append(render_chat(tokenizer, messages, add_generation_prompt=True))
    bos = tokenizer.bos_token
    if bos and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]:
        texts = [t[len(bos) :] if t.startswith(bos) else t for t in texts]
    return texts


def tokenize_prompts(
    tokenizer, prompts: list[str], max_prompt_tokens: int | None, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and mask, (B, P) each, on ``device`` (of :func:`prompt_texts`: with
    ``data.chat_template`` the chat-formatted prompts).

    Raises:
        ValueError: a prompt is empty after tokenization or longer than ``max_prompt_tokens``
            (the prompt is quoted; fix: shorten it or raise ``rollout.max_prompt_tokens``).
    """
    enc = tokenizer(
        prompt_texts(tokenizer, prompts), return_tensors="pt", padding=True, add_special_tokens=True
    )
    lengths = enc["attention_mask"].sum(-1)
    for p, n in zip(prompts, lengths.tolist()):
        if n == 0:
            raise ValueError(f"prompt {p!r} is empty after tokenization")
        if max_prompt_tokens is not None and n > max_prompt_tokens:  # None: the run checked them
            raise ValueError(
                f"prompt {p[:60]!r} has {n} tokens > rollout.max_prompt_tokens={max_prompt_tokens}; "
                "shorten it or raise rollout.max_prompt_tokens"
            )
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def keyed_seed(*parts: object) -> int:
    """A seed in [0, 2**63) keyed by ``parts``: the first 8 bytes of BLAKE2b of their texts
    joined by ``:`` (``keyed_seed("tether", 7, 0, 3)`` hashes ``"tether:7:0:3"``). Every seed
    tether derives from the run's goes through here, each with a prefix of its own."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seeds(seed: int, step: int, indices: Sequence[int]) -> list[int]:
    """One sampling seed per sample: a hash of (run seed, step, global sample index).

    A sample's random stream then depends only on which sample it is, not on how the step's
    batch is split over processes or generate calls (``tests/e2e/test_distributed.py``).

    Returns:
        ``len(indices)`` Python ints, each in [0, 2**63) (host values: each is a row key of the
        sampler's counter-based noise, :func:`tether.core.noise.gumbel_noise`).
    """

    return [keyed_seed("tether", seed, step, int(i)) for i in indices]


class GumbelMaxSampler(LogitsProcessor):
    """Turns greedy decoding into exact sampling from softmax(logits / temperature), per-row seeded.

    Gumbel-max trick: if ``g_v`` are i.i.d. Gumbel(0, 1), ``argmax_v (z_v + g_v)`` is distributed
    exactly as ``softmax(z)`` (Gumbel 1954; Maddison et al. 2014, "A* Sampling", section 2). Here
    ``z = logits / temperature``: the temperature is applied once, in this processor, and nothing
    else touches the logits (greedy decoding adds no warper). Row ``b`` draws its noise from its
    own key ``seeds[b]``: the noise of every row at decoding step ``t`` is one vectorized,
    counter-based computation (:func:`tether.core.noise.gumbel_noise`), a function of
    ``(seeds[b], t, v)`` alone, so a row's sample does not depend on the other rows of the batch,
    on its process or on the device (the integers are the same everywhere; the float64 logs may
    round differently in the last bit).

    It also records, for each row and step, the log-probability of the token it chose under the
    distribution it sampled from (:func:`tether.core.logprobs.logprobs_from_logits` of these
    logits, float32): :attr:`logprobs`, the sampler's side of ``rollout/logprob_mismatch``.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        temperature: float,
        device: torch.device | str = "cpu",
        *,
        keep_logits: bool = False,
    ):
        # the seeds are in [0, 2^63): each fits an int64 as it is
        self.keys = torch.tensor([int(s) for s in seeds], dtype=torch.int64, device=device)  # (B,)
        self.temperature = temperature
        self.steps: list[Tensor] = []
        self.kept: list[Tensor] | None = [] if keep_logits else None
        """With ``keep_logits``: each step's (B, V) logits as bfloat16 (exact for a bfloat16
        model's, whose logits transformers casts to float32 without changing them)."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        z = scores.to(torch.float64) / self.temperature  # (B, V)
        noisy = z + gumbel_noise(self.keys, len(self.steps), scores.shape[-1])  # (B, V); t = calls so far
        chosen = noisy.argmax(-1)  # (B,) what greedy decoding of ``noisy`` picks
        self.steps.append(logprobs_from_logits(scores[:, None, :], chosen[:, None], self.temperature)[:, 0])
        if self.kept is not None:
            self.kept.append(scores.to(torch.bfloat16))
        return noisy

    @property
    def logprobs(self) -> Tensor:
        """(B, n_steps) float32 nats: the chosen tokens' log-probabilities, one column per step."""
        return torch.stack(self.steps, dim=1)

    @property
    def logits(self) -> Tensor | None:
        """(B, n_steps, V) bfloat16: the kept logits, or None (``keep_logits`` off)."""
        return torch.stack(self.kept, dim=1) if self.kept else None


class Sampled(NamedTuple):
    """What :func:`sample_tokens` returns."""

    new_ids: Tensor
    """(B, R) long, R <= ``max_new_tokens``; a finished row's later slots hold what transformers
    wrote there."""
    logprobs: Tensor
    """(B, R) float32 nats: each new token's log-prob under the distribution it was drawn from
    (meaningless after a row ended)."""
    logits: Tensor | None
    """(B, R, V) bfloat16: the sampler's logits at each new position (``keep_logits``), or None."""


COMPILE_SAVINGS = ((1, 0.20), (8, 0.09), (None, 0.02))
"""Share of ``generate``'s time that ``rollout.compile`` saves once compiled, by rows decoded per
process: (at most this many rows, share). Measured with ``benchmarks/generation_floor.py --floor
--compiled`` (SmolLM2-135M, fp32, 2-core Xeon with AMX, ms per decoded token compiled / eager):
0.78 at 1 row, 0.91 at 8, 0.98 at 32, 0.93 at 64; rounded down. The compile takes the Python
and dispatch time of a decode step, which weighs less as the rows' matrix products grow."""

COMPILE_COST_S = 40.0
"""Seconds the compile is assumed to add to a run: measured 19-40 s for SmolLM2-135M on a 2-core
Xeon (the lower with inductor's on-disk cache warm), so that ``auto`` errs toward eager."""


def compile_saving(rows: int) -> float:
    """:data:`COMPILE_SAVINGS`' share for ``rows`` rows decoded together."""
    return next(share for most, share in COMPILE_SAVINGS if most is None or rows <= most)


def compile_repays(generate_s: float, steps_left: int, rows: int) -> bool:
    """Whether ``rollout.compile=auto`` turns compiled decoding on: when the saving over the
    remaining steps, ``steps_left * generate_s * compile_saving(rows)``, exceeds the compile's cost
    :data:`COMPILE_COST_S`.

    Args:
        generate_s: seconds an eager ``generate`` of one step's rollout took (its first step).
        steps_left: steps of the run still to sample.
        rows: rows each process decodes together (its share of ``rollout.batch_size``).

    Returns:
        True where the compile repays itself within the run.
    """
    return steps_left * generate_s * compile_saving(rows) > COMPILE_COST_S


def compile_vector_isa() -> str:
    """The vector instruction set inductor compiles CPU kernels for here (``avx512 ...``, ``avx2``,
    or '' for none): the CPU's own, or what ``ATEN_CPU_CAPABILITY`` forces."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa() or "")


def can_compile(device: torch.device | str) -> str | None:
    """Why decoding cannot be compiled on ``device`` here, or None when it can. On a CPU,
    inductor writes C++ and needs a compiler (``c++``, ``g++`` or ``$CXX``) on the PATH, and
    only its AVX-512 kernels are used: under forced AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``)
    the compiled decode step of a tiny Llama gave NaN logits at static-cache lengths 16 and 18
    and crashed with SIGSEGV in two processes, inside inductor's generated code."""
    if torch.device(device).type == "cpu":
        if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
            return "torch.compile on a CPU needs a C++ compiler (c++, g++ or $CXX), and none is on the PATH"
        isa = compile_vector_isa()
        if not isa.startswith("avx512"):
            return (
                f"inductor would vectorize the decode step for {isa or 'no vector ISA'} here, and its AVX2 "
                "kernels decoded NaN logits and crashed (SIGSEGV) in tether's tests under forced AVX2 "
                "kernels; compiled decoding is built for AVX-512 CPUs only"
            )
    if not hasattr(CompileConfig, "_compile_all_devices"):
        return "this transformers version has no CompileConfig._compile_all_devices (compiling on any device)"
    return None


def bf16_matmul_missing() -> str | None:
    """Why bfloat16 matrix products would not be fast on this CPU, or None when they are: the CPU
    lists AVX-512 BF16 (``avx512_bf16``) or AMX (``amx_bf16``) in ``/proc/cpuinfo``, and oneDNN is
    not held below them (``ONEDNN_MAX_CPU_ISA``, as the forced-AVX2 test run sets it). Without
    them oneDNN emulates bfloat16 in float32, slower than float32 itself."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if capped and capped != "ALL" and "BF16" not in capped and "AMX" not in capped:
        return f"ONEDNN_MAX_CPU_ISA={capped} holds oneDNN below its bfloat16 kernels"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "this system has no /proc/cpuinfo to read the CPU's instructions from"
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return "this CPU has neither AVX-512 BF16 nor AMX (bfloat16 would be emulated, slower than float32)"


COMPILE_CHECK_TOL = 1e-3
"""Nats: how far a compiled decode's sampler log-probs may be from the eager ones in
:func:`compiled_mismatch`. Float32 reassociation of O(10) logits moves a log-prob by ~1e-6 to 1e-5
(1.5e-5 measured on SmolLM2); 1e-3 is far above that and far below a real error (a wrong kernel gave
NaN, or tokens of another distribution)."""


def compiled_mismatch(eager: Rollout, compiled: Rollout) -> str | None:
    """Why a compiled decode of the same prompts and seeds does not reproduce the eager one, or
    None when it does: the same tokens and masks, and the sampler's log-probs finite and within
    :data:`COMPILE_CHECK_TOL` of the eager ones on every valid token.

    Found needed: under forced AVX2 kernels, inductor's compiled attention gave NaN logits at some
    static-cache lengths (16 and 18 positions on a tiny Llama), so the compiled samples were
    another distribution's; eager decoding with the same static cache was exact.
    """
    if not torch.equal(eager.response_ids, compiled.response_ids) or not torch.equal(
        eager.response_mask, compiled.response_mask
    ):
        return "it sampled other tokens than eager decoding with the same seeds"
    mask = eager.response_mask
    a, b = eager.sampler_logprobs[mask], compiled.sampler_logprobs[mask]
    if not torch.isfinite(b).all():
        return "its sampler log-probs are not finite"
    worst = float((a - b).abs().max()) if a.numel() else 0.0
    if worst > COMPILE_CHECK_TOL:
        return (
            f"its sampler log-probs differ from eager ones by up to {worst:.3g} nats (> {COMPILE_CHECK_TOL})"
        )
    return None


def compiled_decode_kwargs(lm: nn.Module, cache_len: int) -> tuple[dict, CompileConfig]:
    """What ``lm.generate`` takes to run its decode steps ``torch.compile``'d: a static key/value
    cache of ``cache_len`` positions (the run's longest prompt plus ``rollout.max_new_tokens``, so
    one graph serves every prompt length of the run) and transformers' compile settings, forced on
    every device (transformers compiles by itself only on accelerators). transformers compiles the
    decode step once per model and keeps it (``get_compiled_call``); prefill runs eager. A new
    shape (rows, cache length) recompiles, up to torch's recompile limit, then runs eager.

    Returns:
        ``({cache argument: StaticCache}, CompileConfig)``.
    """
    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # the flag transformers reads to compile off accelerators
    cache = StaticCache(config=lm.config, max_cache_len=cache_len)
    return {cache_argument(lm): cache}, config  # the causal LM's own forward names it


def end_token_ids(tokenizer, lm: nn.Module | None = None) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS, then each id of the model's
    ``generation_config.eos_token_id`` (an int or a list: chat models such as Llama-3-Instruct and
    Gemma-3-it list their end-of-turn ids there), without repeats.

    Generation stops at any of them and :func:`tether.core.logprobs.response_mask_from_tokens`
    counts up to the first one (TRL missed the extra ids until PR #7039).
    """
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = getattr(lm, "generation_config", None) if lm is not None else None
    extra = getattr(config, "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def special_token_ids(tokenizer, lm: nn.Module | None = None) -> list[int]:
    """The ids the KL attribution counts as special and template tokens
    (``kl/special_token_share``): every end id (:func:`end_token_ids`), the tokenizer's special
    ids (``all_special_ids``: BOS, EOS, PAD, UNK and the additional special tokens, where chat
    templates keep their delimiters such as ``<|im_start|>`` and ``<|im_end|>``) and every added
    token it marks special; sorted, without repeats."""
    ids = set(end_token_ids(tokenizer, lm)) | {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(i))
    return sorted(ids)


STOP_ANCHOR_TOKENS = 16
"""Context tokens decoded before a turn's new tokens when a stop string is searched in them
(:func:`new_text`): a tokenizer's decoding is local past a sequence's first token, so these stand
for the whole context at a cost that does not grow with it."""


def new_text(
    tokenizer, context: Sequence[int], ids: Sequence[int], *, skip_special_tokens: bool = False
) -> str:
    """The text ``ids`` add after ``context``: ``decode(context + ids)`` less ``decode(context)``.

    Decoding ``ids`` alone is not that text for a SentencePiece (Metaspace) tokenizer: it drops the
    word-start space of a sequence's first token, so ``"▁Answer"`` reads ``"Answer"`` at a turn's
    start and a stop string ``" Answer"`` would be missed there. Falls back to ``decode(ids)`` only
    where ``decode(context)`` is not a prefix of ``decode(context + ids)`` (a character whose
    bytes straddle the boundary).
    """
    kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
    head = tokenizer.decode(list(context), **kw)
    whole = tokenizer.decode([*context, *ids], **kw)
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(list(ids), **kw)


def stop_text(tokenizer, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text a stop string is searched in: ``ids`` as they read after the last
    :data:`STOP_ANCHOR_TOKENS` tokens of ``context`` (special tokens kept)."""
    return new_text(tokenizer, list(context)[-STOP_ANCHOR_TOKENS:], ids)


class _StopAfterText(StoppingCriteria):
    """Stops a row once the text of its new tokens (not its context's) contains a stop string,
    read as they follow the context (:func:`stop_text`)."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], context_len: int):
        self.tokenizer, self.stop_strings, self.context_len = tokenizer, list(stop_strings), context_len

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        rows = input_ids.tolist()
        texts = [stop_text(self.tokenizer, r[: self.context_len], r[self.context_len :]) for r in rows]
        done = [any(s in t for s in self.stop_strings) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def sample_tokens(
    lm: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    seeds: Sequence[int],
    ends: Sequence[int],
    pad_token_id: int | None,
    synced: bool = False,
    compile_config: CompileConfig | None = None,
    cache: dict | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    keep_logits: bool = False,
) -> Sampled:
    """Sample continuations of left-padded token ids with :class:`GumbelMaxSampler` under greedy
    decoding (the core of :func:`generate`, and of each policy turn of
    :func:`tether.models.turns.generate_turns`).

    Args:
        input_ids: (B, L) long, left-padded context; attention_mask: (B, L), 0 on padding.
        max_new_tokens: tokens to decode at most.
        temperature: the sampling temperature (> 0).
        seeds: B row keys (:func:`sample_seeds`).
        ends: the ids that end a row (:func:`end_token_ids`); a row stops after its first.
        pad_token_id: what transformers writes after a finished row.
        synced, compile_config, cache: as :func:`generate` sets them.
        stop_strings: texts that also stop a row once its new tokens' text contains one
            (``tokenizer`` decodes them); the context's text is never searched.
        keep_logits: also return the sampler's logits at each new position (bfloat16).

    Returns:
        :class:`Sampled`: ``(new_ids, logprobs, logits)``.
    """
    # A fresh GenerationConfig, not the model folder's: a saved generation_config.json may carry
    # suppress_tokens, repetition penalties, top-k ... that would make the samples differ from
    # softmax(logits / temperature), the distribution every log-probability is computed under.
    # transformers fills unset fields of a passed config from the model's own, so the model's is
    # swapped out for the call. Greedy decoding: the sampler below draws the sample.
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(ends) or None,
        pad_token_id=pad_token_id,
    )
    if compile_config is not None:
        gen.compile_config = compile_config
    stopping = None
    if stop_strings:
        stopping = StoppingCriteriaList([_StopAfterText(tokenizer, stop_strings, input_ids.shape[1])])
    sampler = GumbelMaxSampler(seeds, temperature, input_ids.device, keep_logits=keep_logits)
    saved, lm.generation_config = lm.generation_config, gen
    try:
        out = lm.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=gen,
            logits_processor=LogitsProcessorList([sampler]),
            stopping_criteria=stopping,
            # transformers turns this on by itself for any FSDP-sharded model; tether decides: off
            # on gathered weights (rank 0 evaluates alone), on for per-block gathering
            synced_gpus=synced,
            **(cache or {}),
        )
    finally:
        lm.generation_config = saved
    new_ids = out[:, input_ids.shape[1] :]  # (B, R<=max_new_tokens)
    R = new_ids.shape[1]
    logits = sampler.logits
    return Sampled(new_ids, sampler.logprobs[:, :R], logits[:, :R] if logits is not None else None)


@torch.no_grad()
def generate(
    lm: nn.Module,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    *,
    max_prompt_tokens: int = 64,
    seeds: Sequence[int] | Tensor | None = None,
    share_prefix: bool = False,
    synced: bool = False,
    compiled: bool = False,
    keep_logits: bool = False,
) -> Rollout:
    """Sample one response per prompt from ``lm`` at ``temperature`` (no top-k, no top-p).

    ``synced``: every process decodes until all are done (transformers' ``synced_gpus``; a finished
    row gets pad tokens, masked), for a model whose forward is a collective (FSDP blocks gathered
    one at a time, :func:`tether.models.sharding.generation_weights`). Otherwise each process stops
    at its own length, and one process may generate alone.

    Pure ancestral sampling from softmax(logits / temperature), so the log-probabilities that
    :func:`rollout_logprobs` computes at the same temperature are those of the sampling
    distribution. Sampling is :class:`GumbelMaxSampler` under greedy decoding: row ``b`` is
    seeded with ``seeds[b]`` (see :func:`sample_seeds`), so the samples of a batch are the
    samples of its shards, concatenated. Without ``seeds``, one seed per row is drawn from the
    global torch RNG (seed it for reproducibility).

    This replaced transformers' multinomial sampling (one RNG stream for the whole batch); the
    distribution is the same, but runs of earlier tether versions draw different samples.

    With ``share_prefix`` every prompt but its last token goes into a
    :func:`tether.models.head.prefix_cache` first (rows of a group share one prompt: it runs once),
    and generation starts from that cache; prompts shorter than
    :data:`tether.models.head.SHARED_PREFIX_MIN_POSITIONS` + 1 tokens are generated whole.

    ``compiled`` (``rollout.compile``): the decode steps run ``torch.compile``'d on a static
    key/value cache (:func:`compiled_decode_kwargs`); ``share_prefix`` is then ignored (the prefix
    cache is a dynamic one). The samples are the eager ones up to float32 rounding: the sampler
    and its noise are the same, only the model's arithmetic is fused differently
    (``tests/models/test_sampling.py`` compares them).

    ``keep_logits`` (a low-precision sampler, ``rollout.dtype=bf16``): keep the sampler's logits
    (``Rollout.sampler_logits``) where ``B x max_new_tokens x V`` bfloat16 numbers fit
    :data:`SAMPLER_LOGITS_BYTES`.

    Raises:
        ValueError: ``compiled`` with ``synced`` (a collective forward is not compiled here).
    """
    device = next(lm.parameters()).device
    prompts = list(prompts)  # texts or conversations (a PromptData iterates its prompts)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_tokens, device)
    if seeds is None:
        seeds = torch.randint(0, 2**62, (len(prompts),), device="cpu").tolist()  # host ints
    seeds = [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    ends = end_token_ids(tokenizer, lm)
    cache, compile_config = {}, None
    base = lm.lm if isinstance(lm, AdapterReference) else lm
    if compiled:
        if synced or isinstance(lm, AdapterReference):
            raise ValueError("compiled generation runs a plain model's forward: not synced, not an adapter")
        cache_len = (max_prompt_tokens or prompt_ids.shape[1]) + max_new_tokens  # one graph per run
        cache, compile_config = compiled_decode_kwargs(base, cache_len)
    elif share_prefix and head.shares_prefix(base, prompt_ids.shape[1] - 1):
        with lm.active() if isinstance(lm, AdapterReference) else nullcontext():
            prefix = head.prefix_cache(
                base, prompt_ids[:, :-1], prompt_mask[:, :-1], position_ids_from_mask(prompt_mask)[:, :-1]
            )
        cache = {cache_argument(getattr(base, base.base_model_prefix)): prefix}
    vocab = lm.get_output_embeddings().weight.shape[0] if keep_logits else 0
    keep = keep_logits and len(prompts) * max_new_tokens * vocab * 2 <= SAMPLER_LOGITS_BYTES
    response_ids, sampler_logprobs, sampler_logits = sample_tokens(
        lm,
        prompt_ids,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seeds=seeds,
        ends=ends,
        pad_token_id=tokenizer.pad_token_id,
        synced=synced,
        compile_config=compile_config,
        cache=cache,
        keep_logits=keep,
    )
    response_mask = response_mask_from_tokens(response_ids, ends)  # (B, R)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad))
    is_end = torch.isin(response_ids, torch.tensor(ends, dtype=torch.long, device=device)) & response_mask
    texts = [
        tokenizer.decode(ids[m & ~e], skip_special_tokens=True)
        for ids, m, e in zip(response_ids, response_mask, is_end)
    ]
    ended = is_end.any(-1)  # (B,)
    return Rollout(
        prompts,
        prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        responses=texts,
        ended=ended,
        sampler_logprobs=sampler_logprobs,
        seeds=seeds,
        sampler_logits=sampler_logits,
        compiled=compiled,
    )
