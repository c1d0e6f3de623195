"""tether GRPO against TRL's GRPOTrainer on the same model, prompts, batch and CPU.

Usage:
    python benchmarks/compare_trl.py [steps] [--pairs 2 --steps 12 --warmup 2] [options]
    python benchmarks/compare_trl.py score [--trl-lr 6e-5 --max-steps 60 --gain 0.15] [options]
    python benchmarks/compare_trl.py --make-tiny-model DIR     # a 2-layer random Llama for smoke tests

Needs TRL: pip install -e '.[bench]'. Prints numbers, never asserts (not part of the test suite).

``steps`` (default): per-step time, its phase split and peak RSS of both trainers. Every run is
its own subprocess (peak RSS is that child's ``ru_maxrss``); runs alternate tether, TRL, tether,
TRL ... (``--pairs``) so that a change in the machine's load hits both. Equal work per step:

* the same trainable blocks: ``--trainable-layers all`` (the default, as TRL trains every block)
  sets tether's ``model.trainable_layers=all`` (the embedded model's own default is its last 6);
  ``--trainable-layers N`` trains the last N blocks and the final norm in both (TRL's model is
  loaded here and frozen the same way before GRPOTrainer gets it). Each child counts its
  trainable parameters and the summary prints both, so unequal work shows;

* the same model folder (fp32), the same training prompts in the same order (tether's prompt
  sampler; TRL gets them as an unshuffled dataset), ``--completions`` per step as
  ``--prompts-per-step`` prompts x group, temperature 1.0, no top-k/top-p, ``--max-new-tokens``;
* by default both generate exactly ``--max-new-tokens`` tokens: EOS is suppressed with
  ``min_new_tokens`` (TRL: ``generation_kwargs``; tether: this script wraps the
  GenerationConfig that ``tether.models.sampling.generate`` builds; nothing in src/ changes).
  ``--stop-at-eos`` lets both stop at EOS instead; tokens per step and tokens/s are printed
  either way;
* beta fixed at ``--beta`` with the KL in the loss: TRL 1.16 multiplies k3 by the ratio
  ``pi / pi_old`` (``use_bias_correction_kl``, on by default), tether's default
  ``kl.loss_estimator=k3_is`` (see docs/kl.md); with one optimizer step per batch the ratio is 1
  and ``k3+`` (k3's value, k2's gradient) takes the same step. ``--tether-kl k3`` uses k3 itself
  (``kl.allow_biased_estimator=true``: TRL with ``use_bias_correction_kl=False``). Same cost;
* one optimizer step per generation batch: TRL ``num_iterations=1``, one micro-batch, no gradient
  accumulation; tether ``optim.epochs=1``, ``optim.minibatch_size`` = batch. Both normalize the
  loss by the batch's token count (TRL's default ``loss_type="dapo"``; tether's token mean) and
  divide advantages by the group std; clip 0.2; grad-norm clip 1.0; plain ``torch.optim.AdamW``
  (TRL ``optim="adamw_torch"``), constant learning rate ``--lr``, no weight decay;
* fp32 everywhere (TRL ``bf16=False``), TRL's ``gradient_checkpointing`` off as tether has none
  (``--trl-gradient-checkpointing`` turns TRL's default back on); no evaluation, checkpoints,
  plots or saved models inside the timed steps.

Differences that stay, because they are what each library does per step: tether computes, by
default, the exact full-vocabulary KL and the entropy as metrics (``kl.exact``; pass
``--tether kl.exact=false`` to drop the KL); TRL computes log-probs with a chunked fused LM head.
Neither runs a separate no-grad policy forward here: with one epoch over one minibatch tether
takes the old log-probs from the update's own forward (``optim.reuse_forward``, on by default;
``--tether optim.reuse_forward=false`` restores the extra forward), as TRL does with
``num_iterations=1``. In that mode tether's update_forward policy forward runs inside its scoring step
and is counted under "policy no-grad" in the phase table.

Phases come from wrappers installed in each child, never from edits to either library:
generate (tokenize + sample + decode), reward (VADER), policy no-grad scoring, reference
scoring, exact KL (tether), policy forward + loss, backward (``Tensor.backward``), grad clip
(``clip_grad_norm_``), optimizer (global AdamW step hooks); ``other`` is the rest of the step.

``score``: wall time (training only; evaluation excluded) until the held-out VADER score gains
``--gain`` over the reference. Both children evaluate with tether's own
``tether.run.evaluation.evaluate`` on the same held-out prompts (tether's hash split), the same
sampling seed and settings, every ``--eval-every`` steps; the KL printed is its k1 estimate
(nats per sequence) of those samples against the frozen starting model. Both train on responses
of ``--max-new-tokens`` (TRL's ``max_completion_length``; tether's ``rollout.max_new_tokens``,
whose own default is 16), the length evaluated: a leash that holds 2.5 nats over 16-token
responses spends more over 24, so a held-out KL of longer responses than the run trained on is
no measure of the leash. ``--engines tether`` (or ``trl``) runs one side alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = (
    "generate",
    "reward",
    "policy_nograd",
    "reference",
    "exact_kl",
    "policy_fwd",
    "backward",
    "clip",
    "optimizer",
)
PHASE_LABELS = {
    "generate": "generate",
    "reward": "reward",
    "policy_nograd": "policy no-grad",
    "reference": "reference",
    "exact_kl": "exact KL",
    "policy_fwd": "policy fwd+loss",
    "backward": "backward",
    "clip": "grad clip",
    "optimizer": "AdamW",
    "other": "other",
}


# ---- timing wrappers (installed inside a child process) ------------------------------------------
class Phases:
    """Seconds per phase of the current step; wrappers add to it, begin/end delimit steps."""

    def __init__(self):
        self.now: dict[str, float] = {}
        self.tokens = 0
        self.t0 = 0.0
        self.active = 0  # nesting depth: an inner wrapped call is not counted twice

    def begin(self) -> None:
        self.now, self.tokens, self.t0 = {}, 0, time.perf_counter()

    def end(self) -> dict:
        return {"time": time.perf_counter() - self.t0, "phases": dict(self.now), "tokens": self.tokens}

    def add(self, phase: str, seconds: float) -> None:
        self.now[phase] = self.now.get(phase, 0.0) + seconds

    def wrap(self, fn, phase, count_tokens=None):
        """``fn`` timed into ``phase`` (a name, or a callable of the call's args giving one)."""

        def timed(*args, **kwargs):
            if self.active:
                return fn(*args, **kwargs)
            self.active += 1
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.active -= 1
                name = phase(*args, **kwargs) if callable(phase) else phase
                if name:
                    self.add(name, time.perf_counter() - t)
            if count_tokens is not None:
                self.tokens += count_tokens(out)
            return out

        timed.__wrapped__ = fn
        return timed


def patch(obj, attr: str, phases: Phases, phase, count_tokens=None) -> bool:
    fn = getattr(obj, attr, None)
    if fn is None:
        print(
            f"compare_trl: cannot time {getattr(obj, '__name__', obj)}.{attr} (not found); "
            "its time lands in 'other'",
            file=sys.stderr,
        )
        return False
    setattr(obj, attr, phases.wrap(fn, phase, count_tokens))
    return True


def install_common(phases: Phases) -> None:
    """Backward, grad clipping and optimizer steps, the same way for both libraries."""
    import torch
    import torch.optim.optimizer as optim_hooks

    patch(torch.Tensor, "backward", phases, "backward")
    patch(torch.nn.utils, "clip_grad_norm_", phases, "clip")
    started: list[float] = []
    optim_hooks.register_optimizer_step_pre_hook(lambda opt, a, k: started.append(time.perf_counter()))
    optim_hooks.register_optimizer_step_post_hook(
        lambda opt, a, k: phases.add("optimizer", time.perf_counter() - started.pop())
    )


def force_min_new_tokens_in_tether() -> None:
    """Make ``tether.models.sampling.generate`` sample exactly max_new_tokens tokens (EOS suppressed)."""
    import tether.models.sampling as tr

    original = tr.GenerationConfig

    def config(**kw):
        return original(min_new_tokens=kw["max_new_tokens"], **kw)

    tr.GenerationConfig = config


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB


# ---- configurations ------------------------------------------------------------------------------
def tether_overrides(spec: dict) -> list[str]:
    """tether config overrides for ``spec`` (the same for the tether child and the TRL child's data)."""
    base = [
        "train.algo=grpo",
        f"model.name={spec['model']}",
        f"train.seed={spec['seed']}",
        "eval.n_prompts=0",
        "eval.every=0",
        "train.checkpoint_every=0",
        "train.save_model=false",
        "train.progress=false",
        f"train.output_dir={spec['out']}",
        f"train.steps={spec['total_steps']}",
    ]
    if spec["threads"]:
        base.append(f"train.threads={spec['threads']}")
    if spec["mode"] == "steps":
        n, g = spec["completions"], spec["completions"] // spec["prompts_per_step"]
        base += [
            f"rollout.batch_size={n}",
            f"rollout.group_size={g}",
            f"rollout.max_new_tokens={spec['max_new_tokens']}",
            "rollout.temperature=1.0",
            f"kl.kl_coef={spec['beta']}",
            "kl.controller=fixed",
            "kl.kl_in_loss=true",
            f"kl.loss_estimator={spec['tether_kl']}",
            f"optim.lr={spec['lr']}",
            "optim.epochs=1",
            f"optim.minibatch_size={n}",
            "optim.max_grad_norm=1.0",
            "optim.weight_decay=0",
            f"model.trainable_layers={spec['trainable_layers']}",
        ]
        if spec["tether_kl"] == "k3":
            base.append("kl.allow_biased_estimator=true")
    else:
        # score: responses as long as the evaluation's (and TRL's max_completion_length), so the
        # held-out KL per sequence is over the lengths the leash held (tether's default is 16)
        base.append(f"rollout.max_new_tokens={spec['max_new_tokens']}")
    return base + list(spec["tether"])


def heldout_prompts(config, n: int) -> list[str]:
    from tether.run.setup import load_prompts

    return load_prompts(config)[1][:n]


def run_eval(name, lm, reference, tokenizer, prompts, scorer, spec):
    from tether.models.rollouts import OneTurn, SamplingSettings
    from tether.run.evaluation import EvalSettings, evaluate

    sampler = OneTurn(
        tokenizer,
        SamplingSettings(max_new_tokens=spec["max_new_tokens"], temperature=1.0, max_prompt_tokens=64),
    )
    was_training = lm.training
    lm.eval()
    try:
        r = evaluate(
            name,
            lm,
            reference=reference,
            prompts=prompts,
            sampler=sampler,
            scorers={"proxy": scorer},
            settings=EvalSettings(seed=spec["eval_seed"], batch_size=64),
        )
    finally:
        lm.train(was_training)
    s = r.summary()
    return {"score": s["proxy_mean"], "se": s["proxy_se"], "kl": r.kl, "scores": r.scores["proxy"]}


class ScoreTracker:
    """Evaluation every k steps; training wall time excludes the evaluations."""

    def __init__(self, spec, lm, reference, tokenizer, prompts, scorer):
        self.spec, self.lm, self.ref, self.tok, self.prompts, self.scorer = (
            spec,
            lm,
            reference,
            tokenizer,
            prompts,
            scorer,
        )
        self.points: list[dict] = []
        self.eval_s = 0.0
        self.t0 = time.perf_counter()
        self.base = run_eval("reference", reference, reference, tokenizer, prompts, scorer, spec)
        self.points.append({"step": 0, "train_s": 0.0, **self._gain(self.base)})
        print(
            f"  reference: VADER {self.base['score']:.3f} ± {self.base['se']:.3f} (n={len(prompts)})",
            file=sys.stderr,
        )
        self.t0 = time.perf_counter()

    def _gain(self, r: dict) -> dict:
        diffs = [a - b for a, b in zip(r["scores"], self.base["scores"])]
        m = sum(diffs) / len(diffs)
        se = (sum((d - m) ** 2 for d in diffs) / max(len(diffs) - 1, 1) / len(diffs)) ** 0.5
        return {"score": r["score"], "gain": m, "gain_se": se, "kl": r["kl"]}

    def after_step(self, steps_done: int) -> bool:
        """Evaluate if due; True when the run should stop (target reached and not --run-all)."""
        k, last = self.spec["eval_every"], steps_done == self.spec["total_steps"]
        if steps_done % k and not last:
            return False
        train_s = time.perf_counter() - self.t0 - self.eval_s
        t = time.perf_counter()
        r = run_eval("policy", self.lm, self.ref, self.tok, self.prompts, self.scorer, self.spec)
        self.eval_s += time.perf_counter() - t
        p = {"step": steps_done, "train_s": train_s, **self._gain(r)}
        self.points.append(p)
        print(
            f"  step {steps_done}: {train_s:.0f} s training, VADER {p['score']:.3f} (gain {p['gain']:+.3f} ± "
            f"{p['gain_se']:.3f}), held-out KL {p['kl']:.2f} nats/seq",
            file=sys.stderr,
        )
        return p["gain"] >= self.spec["gain"] and not self.spec["run_all"]


# ---- children ------------------------------------------------------------------------------------
def child_tether(spec: dict) -> dict:
    import torch

    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.trainers.group import GRPOTrainer

    phases = Phases()
    if spec["mode"] == "steps":
        import tether.models.rollouts as trs
        import tether.trainers.base as tb
        import tether.trainers.common as tc
        import tether.trainers.group as tg

        if not spec["stop_at_eos"]:
            force_min_new_tokens_in_tether()
        install_common(phases)
        patch(trs, "generate", phases, "generate", lambda ro: int(ro.response_mask.sum()))
        patch(tb, "checked_scores", phases, "reward")
        reference: list = [None]
        import tether.models.scoring as tr

        def which(model, *a, **k):
            return "reference" if model is reference[0] else "policy_nograd"

        patch(tc, "rollout_logprobs", phases, which)  # the update_forward forward (optim.reuse_forward)
        patch(tr, "response_hidden", phases, which)  # each model's trunk in no-grad scoring
        patch(tr, "head_logits", phases, which)  # each model's LM head, one slice at a time
        patch(tr, "exact_kl_from_logits", phases, "exact_kl")
        patch(tg.GroupTrainer, "minibatch_loss", phases, "policy_fwd")

    config = load_config(None, tether_overrides(spec))
    t = time.perf_counter()
    run = build_run(config)
    setup_s = time.perf_counter() - t
    trainer = GRPOTrainer(run)
    out = {
        "engine": "tether",
        "setup_s": setup_s,
        "threads": torch.get_num_threads(),
        "steps": [],
        "trainable_params": sum(p.numel() for p in run.policy.lm.parameters() if p.requires_grad),
    }
    if spec["mode"] == "steps":
        reference[0] = run.reference
        last = time.perf_counter()
        for step in range(spec["total_steps"]):
            phases.begin()
            row = trainer.step(step)
            rec = phases.end()
            run.writer.log(row)
            now = time.perf_counter()
            rec["wall"], last = now - last, now
            out["steps"].append(rec)
            print(f"  tether step {step}: {row['time/step']:.2f} s, {rec['tokens']} tokens", file=sys.stderr)
        # tether's own split, as logged in the run directory
        rows = [json.loads(line) for line in (run.writer.run_dir / "metrics.jsonl").read_text().splitlines()]
        for rec, row in zip(out["steps"], rows):
            rec["logged"] = {
                k: row[k] for k in ("time/step", "time/generate", "time/score", "time/update") if k in row
            }
            rec["time"] = row.get("time/step", rec["time"])
    else:
        tracker = ScoreTracker(
            spec,
            run.policy.lm,
            run.reference,
            run.tokenizer,
            heldout_prompts(config, spec["n_eval"]),
            run.scorer,
        )
        out["train"] = []
        for step in range(spec["total_steps"]):
            row = trainer.step(step)
            kl = row.get("objective/kl_exact", row.get("objective/kl"))
            out["train"].append({"step": step, "kl": float(kl), "kl_coef": float(row["objective/kl_coef"])})
            print(
                f"  tether step {step}: training KL {kl:.2f} nats/seq, beta {row['objective/kl_coef']:.3f}",
                file=sys.stderr,
            )
            if tracker.after_step(step + 1):
                break
        out["points"] = tracker.points
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def child_trl(spec: dict) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tether.data.prompts import PromptSampler
    from tether.judges.scorers import make_scorer
    from tether.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from tether.models.reference import freeze
    from tether.run.config import load_config
    from tether.run.setup import load_prompts

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    phases = Phases()
    t_setup = time.perf_counter()
    config = load_config(None, tether_overrides(spec))  # for tether's prompts and split only
    path = str(resolve_model_path(config.model.name))
    train_prompts, _ = load_prompts(config)
    if spec["mode"] == "steps":
        n, ppp, lr = spec["completions"], spec["prompts_per_step"], spec["lr"]
    else:
        n, ppp, lr = spec["trl_completions"], spec["trl_prompts_per_step"], spec["trl_lr"]
    g = n // ppp
    # the prompts tether's sampler would draw, in order; TRL repeats each g times (unshuffled)
    sampler = PromptSampler(train_prompts, config.train.seed)
    order = [p for _ in range(spec["total_steps"] + 1) for p in sampler.next_batch(ppp)]
    dataset = Dataset.from_dict({"prompt": order})
    vader = make_scorer("vader")

    def vader_reward(prompts, completions, **kwargs):
        return vader(completions)

    gen_kwargs = (
        {} if (spec["stop_at_eos"] or spec["mode"] == "score") else {"min_new_tokens": spec["max_new_tokens"]}
    )
    args = GRPOConfig(
        output_dir=spec["out"],
        per_device_train_batch_size=n,
        num_generations=g,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=spec["beta"],
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        gradient_checkpointing=spec["trl_gradient_checkpointing"],
        use_cpu=True,
        max_steps=spec["total_steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        seed=spec["seed"],
        shuffle_dataset=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        disable_dropout=True,
        generation_kwargs=gen_kwargs or None,
        model_init_kwargs={"dtype": "float32"},
        log_completions=False,
        mask_truncated_completions=False,
        scale_rewards="group",
        epsilon=0.2,
        use_vllm=False,
    )
    tokenizer = load_tokenizer(path)
    model = path
    if spec["mode"] == "steps":
        from transformers import AutoModelForCausalLM

        from tether.run.setup import freeze_lower_layers

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if spec["trainable_layers"] != "all":  # the same blocks as tether's model.trainable_layers
            freeze_lower_layers(model, int(spec["trainable_layers"]))
    trainer = GRPOTrainer(
        model=model, reward_funcs=vader_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    setup_s = time.perf_counter() - t_setup
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # TRL still logs every step; it just does not print the dicts
    out = {
        "engine": f"trl {trl.__version__}",
        "setup_s": setup_s,
        "threads": torch.get_num_threads(),
        "steps": [],
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "checks": {
            "bf16": trainer.args.bf16,
            "gradient_checkpointing": trainer.args.gradient_checkpointing,
            "policy_dtype": str(next(trainer.model.parameters()).dtype),
            "ref_dtype": str(next(trainer.ref_model.parameters()).dtype) if trainer.ref_model else None,
            "optimizer": trainer.args.optim,
            "loss_type": trainer.args.loss_type,
            "lr_scheduler": str(trainer.args.lr_scheduler_type),
        },
    }

    if spec["mode"] == "steps":
        install_common(phases)
        ref = trainer.ref_model
        patch(trainer, "_generate", phases, "generate", lambda res: sum(len(c) for c in res[1]))
        patch(trainer, "_calculate_rewards", phases, "reward")
        patch(
            trainer,
            "_get_per_token_logps_and_entropies",
            phases,
            lambda model, *a, **k: (
                "reference"
                if model is ref
                else ("policy_fwd" if torch.is_grad_enabled() else "policy_nograd")
            ),
        )
        patch(trainer, "compute_loss", phases, "policy_fwd")  # policy forward + GRPO loss

        class StepTimer(TrainerCallback):
            last = None

            def on_train_begin(self, a, state, control, **kw):
                StepTimer.last = time.perf_counter()

            def on_step_begin(self, a, state, control, **kw):
                phases.begin()

            def on_step_end(self, a, state, control, **kw):
                rec = phases.end()
                now = time.perf_counter()
                rec["wall"], StepTimer.last = now - StepTimer.last, now
                out["steps"].append(rec)
                print(
                    f"  trl step {state.global_step - 1}: {rec['time']:.2f} s, {rec['tokens']} tokens",
                    file=sys.stderr,
                )

        trainer.add_callback(StepTimer())
    else:
        reference = freeze(load_causal_lm(path))
        tracker_box: list = []

        class Evaluate(TrainerCallback):
            def on_train_begin(self, a, state, control, **kw):
                tracker_box.append(
                    ScoreTracker(
                        spec,
                        trainer.model,
                        reference,
                        tokenizer,
                        heldout_prompts(config, spec["n_eval"]),
                        vader,
                    )
                )

            def on_step_end(self, a, state, control, **kw):
                if tracker_box[0].after_step(state.global_step):
                    control.should_training_stop = True

        trainer.add_callback(Evaluate())
    trainer.train()
    if spec["mode"] == "score":
        out["points"] = tracker_box[0].points
    out["peak_rss_gb"] = peak_rss_gb()
    return out


# ---- parent --------------------------------------------------------------------------------------
def run_child(engine: str, spec: dict, tmp: Path, tag: str) -> dict:
    spec = dict(spec, out=str(tmp / f"{tag}-{engine}"))
    spec_path, result_path = tmp / f"{tag}-{engine}.spec.json", tmp / f"{tag}-{engine}.result.json"
    spec_path.write_text(json.dumps(spec))
    print(f"compare_trl: {tag}: {engine} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", engine, "--spec", str(spec_path), "--result", str(result_path)]
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"compare_trl: the {engine} run failed (exit {proc.returncode}); see its output above"
        )
    res = json.loads(result_path.read_text())
    res["process_s"] = time.perf_counter() - t
    return res


def med(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def summarize(res: dict, warmup: int) -> dict:
    rows = res["steps"][warmup:]
    s = {
        "engine": res["engine"],
        "n": len(rows),
        "step": med(r["time"] for r in rows),
        "wall": med(r["wall"] for r in rows),
        "tokens": med(r["tokens"] for r in rows),
        "rss": res["peak_rss_gb"],
        "setup": res["setup_s"],
        "threads": res["threads"],
        "trainable_params": res.get("trainable_params"),
    }
    s["phases"] = {p: med(r["phases"].get(p, 0.0) for r in rows) for p in PHASES}
    s["phases"]["other"] = med(r["time"] - sum(r["phases"].values()) for r in rows)
    if rows and "logged" in rows[0]:
        s["logged"] = {k: med(r["logged"][k] for r in rows) for k in rows[0]["logged"]}
    return s


def main_steps(args, spec: dict, tmp: Path) -> None:
    sums, sums_checks = [], []
    for i in range(args.pairs):
        results = {e: run_child(e, spec, tmp, f"pair{i + 1}") for e in ("tether", "trl")}
        sums_checks.append(results["trl"].get("checks"))
        pair = {e: summarize(r, args.warmup) for e, r in results.items()}
        sums.append(pair)
        t, r = pair["tether"], pair["trl"]
        print(
            f"pair {i + 1}: median step (after {args.warmup} warm-up) tether {t['step']:.3f} s, "
            f"{r['engine']} {r['step']:.3f} s; tether/TRL = {t['step'] / r['step']:.2f}; "
            f"peak RSS tether {t['rss']:.2f} GB, TRL {r['rss']:.2f} GB (ratio {t['rss'] / r['rss']:.2f})",
            flush=True,
        )

    print()
    eos = "stop at EOS" if args.stop_at_eos else f"exactly {args.max_new_tokens} tokens (EOS suppressed)"
    print(
        f"{args.completions} completions per step ({args.prompts_per_step} prompt(s) x "
        f"{args.completions // args.prompts_per_step}), {eos}, beta {args.beta} fixed, lr {args.lr}, fp32, "
        f"torch threads {sums[0]['tether']['threads']}; medians over steps "
        f"{args.warmup}..{args.warmup + args.steps - 1}"
    )
    counts = {e: sums[0][e]["trainable_params"] for e in ("tether", "trl")}
    print(
        f"trained blocks: {args.trainable_layers} (--trainable-layers); trainable parameters: "
        f"tether {counts['tether']:,}, TRL {counts['trl']:,}"
        + ("" if counts["tether"] == counts["trl"] else "  <-- NOT EQUAL WORK")
    )
    print()
    cols = [
        "run",
        "median step s",
        "loop s/step",
        "tokens/step",
        "tokens/s",
        *[PHASE_LABELS[p] for p in PHASES],
        "other",
        "peak RSS GB",
        "setup s",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for i, pair in enumerate(sums):
        for e in ("tether", "trl"):
            s = pair[e]
            cells = [
                f"{s['engine']} #{i + 1}",
                f"{s['step']:.3f}",
                f"{s['wall']:.3f}",
                f"{s['tokens']:.0f}",
                f"{s['tokens'] / s['step']:.1f}",
                *[f"{s['phases'][p]:.3f}" for p in PHASES],
                f"{s['phases']['other']:.3f}",
                f"{s['rss']:.2f}",
                f"{s['setup']:.1f}",
            ]
            print("| " + " | ".join(cells) + " |")
    print()
    print("| pair | tether/TRL step time | tether/TRL peak RSS |")
    print("|---|---|---|")
    for i, pair in enumerate(sums):
        t, r = pair["tether"], pair["trl"]
        print(f"| {i + 1} | {t['step'] / r['step']:.2f} | {t['rss'] / r['rss']:.2f} |")
    print(f"TRL settings as built: {sums_checks[0]}")
    for i, pair in enumerate(sums):
        if "logged" in pair["tether"]:
            lg = pair["tether"]["logged"]
            print(
                f"tether #{i + 1} metrics.jsonl medians: "
                + ", ".join(f"{k} {v:.3f} s" for k, v in lg.items())
            )


def main_score(args, spec: dict, tmp: Path) -> None:
    res = {}
    for engine in args.engines.split(","):
        s = dict(
            spec,
            total_steps=args.max_steps if engine == "trl" else args.tether_max_steps,
            eval_every=args.eval_every if engine == "trl" else (args.tether_eval_every or args.eval_every),
        )
        res[engine] = run_child(engine, s, tmp, "score")
    print()
    print(
        f"target: held-out VADER gain >= {args.gain:+.2f} over the reference ({args.n_eval} held-out "
        "prompts, "
        f"eval seed {args.eval_seed}); TRL lr {args.trl_lr}, {args.trl_completions} completions/step; "
        f"tether: GRPO defaults + {args.tether or 'no overrides'}"
    )
    print()
    print("| run | step | training s | VADER | gain ± SE | held-out KL nats/seq |")
    print("|---|---|---|---|---|---|")
    for _engine, r in res.items():
        for p in r["points"]:
            print(
                f"| {r['engine']} | {p['step']} | {p['train_s']:.0f} | {p['score']:.3f} | "
                f"{p['gain']:+.3f} ± {p['gain_se']:.3f} | {p['kl']:.2f} |"
            )
    print()
    for _engine, r in res.items():
        hit = next((p for p in r["points"][1:] if p["gain"] >= args.gain), None)
        if hit:
            print(
                f"{r['engine']}: reached {hit['gain']:+.3f} at step {hit['step']} after "
                f"{hit['train_s']:.0f} s of "
                f"training, held-out KL {hit['kl']:.2f} nats/seq"
            )
        else:
            last = r["points"][-1]
            print(
                f"{r['engine']}: did not reach {args.gain:+.2f} in {last['step']} steps "
                f"({last['train_s']:.0f} s); "
                f"last gain {last['gain']:+.3f}, KL {last['kl']:.2f} nats/seq"
            )


def make_tiny_model(out: str) -> None:
    """A random 2-layer Llama (hidden 16) with SmolLM2's tokenizer, for smoke tests."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tether.models.loading import resolve_model_path

    src = resolve_model_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    print(out)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("mode", nargs="?", default="steps", choices=["steps", "score"])
    ap.add_argument(
        "--model", default="smollm2-135m", help="model.name: smollm2-135m or a save_pretrained folder"
    )
    ap.add_argument("--pairs", type=int, default=2, help="steps: tether/TRL run pairs, alternated")
    ap.add_argument("--steps", type=int, default=12, help="steps: measured steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps: steps run before measuring")
    ap.add_argument("--completions", type=int, default=8, help="steps: completions per step")
    ap.add_argument(
        "--prompts-per-step", type=int, default=1, help="steps: prompts per step (group = completions / this)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument(
        "--stop-at-eos", action="store_true", help="steps: let both stop at EOS (default: exactly N tokens)"
    )
    ap.add_argument(
        "--beta",
        type=float,
        default=0.05,
        help="steps: fixed KL coefficient (TRL's beta, tether's kl.kl_coef)",
    )
    ap.add_argument("--lr", type=float, default=1e-5, help="steps: learning rate of both")
    ap.add_argument(
        "--trainable-layers",
        default="all",
        help="steps: blocks both train: all (default, as TRL does) or N, the last N in both",
    )
    ap.add_argument(
        "--tether-kl",
        default="k3_is",
        choices=["k3_is", "k3+", "k3", "k2"],
        help="steps: tether's kl.loss_estimator",
    )
    ap.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's own default (off here)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads in both (default: torch's default)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tether",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="extra tether config override (repeatable), e.g. --tether kl.exact=false",
    )
    ap.add_argument("--trl-lr", type=float, default=6e-5, help="score: TRL learning rate")
    ap.add_argument("--trl-completions", type=int, default=8, help="score: TRL completions per step")
    ap.add_argument("--trl-prompts-per-step", type=int, default=1, help="score: TRL prompts per step")
    ap.add_argument("--max-steps", type=int, default=60, help="score: TRL step limit")
    ap.add_argument(
        "--tether-max-steps", type=int, default=16, help="score: tether step limit (its default run)"
    )
    ap.add_argument("--eval-every", type=int, default=5, help="score: evaluate TRL every k steps")
    ap.add_argument("--tether-eval-every", type=int, default=2, help="score: evaluate tether every k steps")
    ap.add_argument("--gain", type=float, default=0.15, help="score: target held-out VADER gain")
    ap.add_argument("--n-eval", type=int, default=64, help="score: held-out prompts")
    ap.add_argument("--eval-seed", type=int, default=1234, help="score: sampling seed of every evaluation")
    ap.add_argument("--run-all", action="store_true", help="score: keep training after the target is reached")
    ap.add_argument(
        "--engines", default="tether,trl", choices=["tether,trl", "tether", "trl"], help="score: which to run"
    )
    ap.add_argument("--keep", default=None, help="directory for the runs' outputs (default: a temporary one)")
    ap.add_argument(
        "--make-tiny-model", metavar="DIR", help="write a tiny random Llama for smoke tests and exit"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        res = (child_tether if args.child == "tether" else child_trl)(spec)
        Path(args.result).write_text(json.dumps(res))
        return 0
    if args.make_tiny_model:
        make_tiny_model(args.make_tiny_model)
        return 0
    if args.completions % args.prompts_per_step or args.trl_completions % args.trl_prompts_per_step:
        ap.error("completions must be a multiple of prompts per step")
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        ap.error("needs TRL: pip install -e '.[bench]'")

    spec = {
        "mode": args.mode,
        "model": args.model,
        "seed": args.seed,
        "threads": args.threads,
        "completions": args.completions,
        "prompts_per_step": args.prompts_per_step,
        "max_new_tokens": args.max_new_tokens,
        "stop_at_eos": args.stop_at_eos,
        "beta": args.beta,
        "lr": args.lr,
        "trainable_layers": args.trainable_layers,
        "tether_kl": args.tether_kl,
        "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
        "tether": args.tether,
        "trl_lr": args.trl_lr,
        "trl_completions": args.trl_completions,
        "trl_prompts_per_step": args.trl_prompts_per_step,
        "gain": args.gain,
        "n_eval": args.n_eval,
        "eval_seed": args.eval_seed,
        "run_all": args.run_all,
        "total_steps": args.warmup + args.steps,
        "eval_every": args.eval_every,
    }
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tether-vs-trl-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"compare_trl: runs in {tmp}", file=sys.stderr)
    (main_steps if args.mode == "steps" else main_score)(args, spec, tmp)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
