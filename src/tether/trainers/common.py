"""What every trainer shares: building a run (models, data, scorer, run dir) and scoring rollouts."""

from __future__ import annotations

import datetime as _dt
import logging
import random
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from tether.config import Config, check_world_size, dump_config
from tether.distributed import barrier, gather_objects, is_main
from tether.data import DEFAULT_PROMPTS, movie_prompts, prompt_file_lines, read_prompt_file, split_prompts
from tether.metrics import RunWriter
from tether.models import (
    PolicyWithValue,
    add_lora,
    check_reference,
    count_reference_forwards,
    fingerprint,
    load_causal_lm,
    load_tokenizer,
    make_reference,
    resolve_model_path,
)
from tether.rollout import Rollout, Scored, prompt_texts, score_logprobs, score_policy_and_reference, use_chat_template
from tether.scorers import Scorer, make_scorer

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def default_run_dir(algo: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{algo}-{stamp}"


def load_prompts(config: Config) -> tuple[list[str], list[str]]:
    """(train, heldout) prompts for ``config.data``."""
    d = config.data
    if d.prompts == DEFAULT_PROMPTS:
        return movie_prompts(config.train.seed, d.min_words, d.max_words, d.heldout_fraction)
    return split_prompts(read_prompt_file(d.prompts), d.heldout_fraction)


def freeze_lower_layers(lm: nn.Module, trainable_layers: int | None) -> None:
    """Keep only the last ``trainable_layers`` blocks (and the final norm) trainable."""
    if trainable_layers is None:
        return
    trunk = getattr(lm, lm.base_model_prefix)
    for p in lm.parameters():
        p.requires_grad_(False)
    layers = getattr(trunk, "layers", None) or getattr(trunk, "h", None)
    if layers is None:
        raise ValueError(f"model.trainable_layers: cannot find the transformer blocks of {type(lm).__name__} "
                         "(no .layers or .h); leave model.trainable_layers unset")
    for block in list(layers)[len(layers) - trainable_layers :] if trainable_layers else []:
        for p in block.parameters():
            p.requires_grad_(True)
    if trainable_layers and hasattr(trunk, "norm"):
        for p in trunk.norm.parameters():
            p.requires_grad_(True)


def check_prompt_lengths(tokenizer, prompts: list[str], max_prompt_tokens: int, source: str | None = None) -> None:
    """Refuse, before training starts, any prompt that is empty or longer than the limit.

    Args:
        source: the prompt file, if any: the error then names its line (``FILE:LINE``).

    Raises:
        ValueError: naming the prompt (and its file and line) and the field to change.
    """
    for start in range(0, len(prompts), 2048):
        chunk = prompts[start : start + 2048]
        lengths = [len(ids) for ids in tokenizer(prompt_texts(tokenizer, chunk), add_special_tokens=True)["input_ids"]]
        for i, (p, n) in enumerate(zip(chunk, lengths)):
            if n == 0 or n > max_prompt_tokens:
                where = f"prompt {start + i + 1}"
                if source is not None:
                    where = f"data.prompts: {source}:{prompt_line(source, p)}:"
                raise ValueError(
                    f"{where} ({p[:60]!r}) has {n} tokens; rollout.max_prompt_tokens="
                    f"{max_prompt_tokens} (shorten the prompt or raise rollout.max_prompt_tokens)")


def prompt_line(path: str | Path, prompt: str) -> int | str:
    """1-based line of ``prompt``'s first occurrence in a prompt file (``"?"`` if absent)."""
    return next((i for i, p in prompt_file_lines(path) if p == prompt), "?")


@dataclass
class Run:
    """Everything a trainer needs, built from a validated :class:`Config`."""

    config: Config
    policy: PolicyWithValue
    reference: nn.Module | None
    """None when no KL is used or monitored (kl_coef 0 and kl.monitor false)."""
    tokenizer: object
    scorer: Scorer
    train_prompts: list[str]
    heldout_prompts: list[str]
    writer: RunWriter
    reference_fingerprint: str | None
    reference_forwards: list[int]
    """[count] of reference forward passes of this process (a pre-hook increments it)."""
    accelerator: Accelerator | None = None
    """accelerate's handle on the processes (one without ``accelerate launch``); the trainers
    wrap the policy with ``accelerator.prepare`` (DDP when there are several)."""
    run_dir_existed: bool = False
    """The run directory existed (empty) before this run, see :func:`discard_failed_start`."""


def check_full_precision(mixed_precision: str) -> None:
    """Refuse accelerate's mixed precision (``accelerate launch --mixed_precision`` or
    ``ACCELERATE_MIXED_PRECISION``) before anything is written.

    ``accelerator.prepare`` would run the update's forward under bf16/fp16 autocast while the old
    and reference log-probs come from the fp32 model: the seeds' precision mismatch (bf16 is
    0.028 nats per token off fp32 on SmolLM2, docs/performance.md), so the first ratio is not 1
    and the step-0 KL of the update's forward is not 0.

    Raises:
        ValueError: ``mixed_precision`` is not ``"no"``.
    """
    if mixed_precision != "no":
        raise ValueError(
            f"accelerate's mixed_precision={mixed_precision!r} (from `accelerate launch --mixed_precision` or "
            "ACCELERATE_MIXED_PRECISION): tether scores the old and reference log-probs in fp32, so an autocast "
            "update would see a precision mismatch (a first ratio != 1); run with --mixed_precision no "
            "(or unset ACCELERATE_MIXED_PRECISION)")


def build_run(config: Config, scorer: Scorer | None = None, resume: bool = False) -> Run:
    """Load model, reference, tokenizer, prompts and scorer; create the run directory.

    The config is validated before this is called; data and scorer load before the model so a
    bad prompt file or scorer fails in seconds, not after the model loads.
    """
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    # tether's tensors live on the CPU; several processes talk over gloo (docs/distributed.md)
    accelerator = Accelerator(cpu=True)
    check_full_precision(accelerator.mixed_precision)
    check_world_size(config, accelerator.num_processes)
    seed_everything(config.train.seed)
    train_prompts, heldout = load_prompts(config)
    scorer = scorer if scorer is not None else make_scorer(config.reward.scorer)
    run_dir = Path(config.train.output_dir) if config.train.output_dir else default_run_dir(config.train.algo)
    run_dir = gather_objects(run_dir)[0]  # rank 0's (a default name holds the time)
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        hint = f" or continue it with: tether train --resume {run_dir}" if (run_dir / "checkpoints").exists() else ""
        raise FileExistsError(f"train.output_dir={run_dir} already holds a run (it is not empty); "
                              f"choose another directory{hint}")
    if resume and not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"--resume {run_dir}: not a tether run directory (no config.yaml)")
    barrier()  # every process checked the folder before the first one writes into it
    existed = run_dir.exists()
    writer = RunWriter(run_dir)
    try:
        if not resume and is_main():
            dump_config(config, run_dir / "config.yaml")

        for w in config.placement.warnings:
            log.warning("tether: warning: %s", w)
        path = resolve_model_path(config.model.name)
        tokenizer = load_tokenizer(path)
        if config.data.chat_template:
            use_chat_template(tokenizer)
        check_prompt_lengths(tokenizer, train_prompts + heldout, config.rollout.max_prompt_tokens,
                             None if config.data.prompts == DEFAULT_PROMPTS else config.data.prompts)
        lm = load_causal_lm(path)
        m = config.model
        if m.lora:  # a peft model: the policy trains adapters, the reference reuses its frozen base
            lm = add_lora(lm, m.lora_r, m.lora_alpha, m.lora_target_modules, m.adapter)
        needs_reference = config.placement.needs_reference or config.train.algo == "dpo"
        reference = make_reference(lm) if needs_reference else None
        forwards = [0]
        if reference is not None:
            # count on the trunk: every path (scoring, generation) runs it exactly once per forward
            count_reference_forwards(reference, forwards)
        freeze_lower_layers(lm, config.model.trainable_layers)
        # rows share prompts only in groups; otherwise the prefix pass would be one trunk call more
        share_prefix = config.model.share_prompt_prefix and config.rollout.group_size > 1
        policy = PolicyWithValue(lm, head_chunk=config.kl.exact_chunk_size, share_prefix=share_prefix)
        if reference is not None:
            check_reference(policy, reference)
        return Run(config, policy, reference, tokenizer, scorer, train_prompts, heldout, writer,
                   fingerprint(reference) if reference is not None else None, forwards, accelerator, existed)
    except BaseException:
        if not resume and is_main():
            discard_failed_start(run_dir, existed)
        raise


def discard_failed_start(run_dir: Path, existed: bool) -> None:
    """Remove what a run that failed before its first step wrote (config.yaml, the reference's
    evaluation ...), so the same command can be run again once the input is fixed.

    The folder was checked to be empty or absent when the run started, so everything in it is
    this run's; a folder that existed (empty) is emptied, not removed.
    """
    if not run_dir.exists():
        return
    if not existed:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for child in run_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def make_optimizer(params: list, lr: float, weight_decay: float, fused: bool = True) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over ``params``; torch's fused kernel when ``fused``.

    The fused kernel updates each weight, its gradient and both moments in one pass (CPU and
    CUDA); it falls back to the per-tensor loop where a parameter's device has no fused kernel.
    """
    fused = fused and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def optimizer_step(optimizer: torch.optim.Optimizer, params: list, loss: Tensor | Sequence[Callable[[], Tensor]],
                   max_grad_norm: float, name: str, accelerator: Accelerator | None = None,
                   model: nn.Module | None = None) -> Tensor:
    """Backward, clip the global gradient norm, refuse a non-finite one, step; returns the norm.

    ``loss`` is the minibatch's loss, or one callable per micro-batch (``optim.micro_batch_size``)
    returning that micro-batch's share of it: each runs its forward and backward in turn, the
    gradients add up, and the optimizer steps once, as for the whole minibatch (gradient
    accumulation). With an ``accelerator`` the backward and the clipping are accelerate's: under
    DDP the backward all-reduces (averages) the gradients over the processes, so every process
    clips and steps with the same gradient; with micro-batches only the last one all-reduces
    (``accelerator.no_sync(model)`` around the others).

    Raises:
        FloatingPointError: the gradient norm is NaN or inf (the step is not taken, so the
            weights and the last checkpoint stay good).
    """
    optimizer.zero_grad(set_to_none=True)
    parts = [lambda: loss] if torch.is_tensor(loss) else list(loss)
    for i, part in enumerate(parts):
        defer = accelerator is not None and model is not None and i < len(parts) - 1
        with accelerator.no_sync(model) if defer else nullcontext():
            last = part()
            if accelerator is None:
                last.backward()
            else:
                accelerator.backward(last)
    if accelerator is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    else:
        grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm {float(grad_norm)} in the {name} update "
                                 f"(loss {float(last.detach())}); stopping before the weights change")
    optimizer.step()
    # free the gradients now, not at the next step's zero_grad: otherwise a full copy of the
    # trainable weights stays resident through the next generation and forward, the step's peak
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def micro_batches(rows: Tensor, micro_batch_size: int | None) -> list[Tensor]:
    """``rows`` (this process's rows of a minibatch) in consecutive chunks of
    ``micro_batch_size`` (``optim.micro_batch_size``); one chunk when it is None."""
    return [rows] if micro_batch_size is None else list(rows.split(micro_batch_size))


@dataclass
class ScoredBatch:
    """No-grad quantities of a rollout, each (B, R) float32."""

    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    """None when no reference model is built."""
    values: Tensor | None
    entropy: Tensor
    exact_kl: Tensor | None
    graded: Scored | None = None
    """The policy's forward with its autograd graph, when ``score_rollout`` was given a
    ``graded_policy`` (one minibatch): the update differentiates it instead of a second forward."""


@torch.no_grad()
def score_rollout(
    policy: nn.Module,
    reference: nn.Module | None,
    rollout: Rollout,
    temperature: float,
    row_chunks: list[Tensor],
    with_values: bool,
    exact_kl: bool,
    exact_chunk_size: int = 256,
    graded_policy: nn.Module | None = None,
) -> ScoredBatch:
    """Policy and reference log-probabilities (and values, entropy, exact KL) of a rollout.

    Rows are scored in the groups ``row_chunks`` (index tensors covering every row once), so the
    first PPO minibatch sees exactly the inputs its old log-probabilities came from and the
    ratio at step 0 is exactly 1. No-grad logits are held for one LM-head slice at a time
    (:func:`tether.rollout.score_policy_and_reference`), never for a whole group.

    With ``graded_policy`` (the module the update differentiates; one group only) the policy's
    forward runs with autograd on and is returned as ``graded``; the old log-probs, entropy and
    exact KL are its detached values, the same numbers a no-grad forward gives.
    """
    B, R = rollout.response_ids.shape
    exact_kl = exact_kl and reference is not None
    if graded_policy is not None and len(row_chunks) != 1:
        raise ValueError(f"graded_policy needs one row group, got {len(row_chunks)}")
    out = {k: torch.zeros(B, R) for k in ("old", "ref", "values", "entropy", "exact")}
    graded = policy_logits = None
    for idx in row_chunks:
        part = rollout.select(idx)
        if graded_policy is not None:
            with torch.enable_grad():
                graded = score_logprobs(graded_policy, part, temperature, keep_logits=True)
            policy_logits = graded.logits.detach()  # (B, R, V), held by the graph anyway
            graded.logits = None  # the graph keeps what the backward needs; drop the reference to it
        pol, ref, exact = score_policy_and_reference(policy, reference, part, temperature, with_values, exact_kl,
                                                     policy_logits, exact_chunk_size)
        out["old"][idx], out["entropy"][idx] = pol.logprobs, pol.entropy
        if with_values:
            out["values"][idx] = pol.values
        if reference is not None:
            out["ref"][idx] = ref.logprobs
        if exact_kl:
            out["exact"][idx] = exact
    return ScoredBatch(out["old"], out["ref"] if reference is not None else None,
                       out["values"] if with_values else None, out["entropy"],
                       out["exact"] if exact_kl else None, graded)
