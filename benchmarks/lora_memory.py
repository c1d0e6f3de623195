"""Peak memory and median PPO step time: full fine-tune against LoRA, at the same batch.

Usage:
    python benchmarks/lora_memory.py [--steps N] [--warmup K] [--lora-r R] [--tiny] [section.field=value ...]

Each variant runs in its own subprocess (a fresh interpreter, so one variant's peak cannot hide
in the other's) and reports its own peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), the median
step time over the measured steps, and how many parameters the optimizer holds. The full
fine-tune keeps a deep-copied frozen reference and AdamW moments for every weight; LoRA keeps no
second copy (its reference is the same base with the adapters disabled) and AdamW moments for the
adapters and the value head only.

``--tiny`` swaps the default model (SmolLM2-135M) for a 2-layer random Llama built on the spot,
to check that the script runs; its numbers mean nothing. Prints numbers, never asserts.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _tiny_model(folder: Path) -> tuple[Path, Path]:
    """A 2-layer random Llama + byte-level BPE tokenizer, and a prompt file, under ``folder``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [
        "the movie was great and the acting was wonderful",
        "a terrible boring film with awful dialogue",
        "i loved this story, a delightful and moving picture",
        "the plot is weak but the music is good",
    ] * 4
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model_dir, prompts = folder / "model", folder / "prompts.txt"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompts.write_text("\n".join(f"the movie number {i} was" for i in range(64)) + "\n")
    return model_dir, prompts


def child(variant: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    """Build a run, take ``warmup + steps`` PPO steps; the measurements of this process."""
    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.trainers.ppo import PPOTrainer

    out = tempfile.mkdtemp(prefix=f"tether-lora-bench-{variant}-")
    config = load_config(
        None, ["eval.n_prompts=0", "train.save_model=false", f"train.output_dir={out}", *overrides]
    )
    run = build_run(config)
    trainer = PPOTrainer(run)
    times = []
    for step in range(warmup + steps):
        row = trainer.step(step)
        if step >= warmup:
            times.append(row["time/step"])
        print(f"{variant} step {step}: {row['time/step']:.2f} s", file=sys.stderr)
    c = config
    return {
        "variant": variant,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        / 1024**2,  # ru_maxrss is KiB on Linux
        "median_step_s": statistics.median(times),
        "trainable_params": sum(p.numel() for p in trainer.params),
        "total_params": sum(p.numel() for p in run.policy.parameters()),
        "batch": f"{c.rollout.batch_size} x {c.rollout.max_new_tokens} new tokens, minibatch "
        f"{c.optim.minibatch_size}, {c.optim.epochs} epochs",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    ap.add_argument("--lora-r", type=int, default=8, help="LoRA rank of the LoRA variant")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny random model instead of the default (smoke test)"
    )
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides applied to both variants")
    args = ap.parse_args()

    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.warmup, args.overrides)))
        return 0

    overrides = list(args.overrides)
    if args.tiny:
        model_dir, prompts = _tiny_model(Path(tempfile.mkdtemp(prefix="tether-lora-bench-tiny-")))
        overrides = [
            f"model.name={model_dir}",
            f"data.prompts={prompts}",
            "rollout.batch_size=8",
            "optim.minibatch_size=4",
            "rollout.max_new_tokens=8",
            *overrides,
        ]
    results = {}
    for variant, extra in (("full", []), ("lora", [f"model.lora_r={args.lora_r}"])):
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *overrides,
            *extra,
        ]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"the {variant} run failed (exit {proc.returncode}); its output is above", file=sys.stderr)
            return 1
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        results[variant] = json.loads(line[len("RESULT ") :])
        print(f"{variant}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    full, lora = results["full"], results["lora"]
    print(
        f"model: {'tiny random Llama (smoke test)' if args.tiny else 'default'}; batch {full['batch']}; "
        f"LoRA rank {args.lora_r}; {args.steps} measured steps after {args.warmup} warm-up"
    )
    print(f"{'':<6} {'peak RSS':>10} {'median step':>12} {'trainable params':>18} {'total params':>14}")
    for r in (full, lora):
        print(
            f"{r['variant']:<6} {r['peak_rss_gb']:>8.2f} GB {r['median_step_s']:>10.2f} s "
            f"{r['trainable_params']:>18,} {r['total_params']:>14,}"
        )
    print(
        f"LoRA / full: peak RSS {lora['peak_rss_gb'] / full['peak_rss_gb']:.2f}x "
        f"({full['peak_rss_gb'] - lora['peak_rss_gb']:+.2f} GB saved), "
        f"median step {lora['median_step_s'] / full['median_step_s']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
