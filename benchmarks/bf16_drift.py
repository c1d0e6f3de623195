"""How far a bf16 run's policy drifts from a float32 run's, against how far training moves.

Usage: python benchmarks/bf16_drift.py [--steps N] [--algo grpo] [section.field=value ...]

Trains a tiny random Llama (the test fixtures' tokenizer, built here; nothing is downloaded)
twice from the same seed and the same start, once with ``model.dtype=float32`` and once with
``model.dtype=bfloat16`` (float32 master weights), then measures on held-out prompts, sampling
from the float32 run's policy, the exact per-token KL (nats per token, averaged over valid
tokens, both policies evaluated in float32):

* drift: KL(pi_fp32 || pi_bf16), the two runs' policies after N steps;
* movement: KL(pi_fp32 || pi_ref), how far the float32 run moved from the start;
* seed drift: KL(pi_fp32 || pi_fp32'), a third run in float32 with another ``train.seed`` (other
  samples, other prompt order): how far two float32 runs land apart anyway.

drift / movement is the share of the run's movement that precision changed; drift against seed
drift says whether bf16 moves the result more than resampling does. Prints numbers, never asserts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tests.conftest import make_tiny_llama, make_tokenizer
    from tether.core.kl import exact_kl_from_logits
    from tether.core.masked import masked_mean
    from tether.models.sampling import generate, sample_seeds
    from tether.models.scoring import rollout_logprobs
    from tether.run.config import load_config
    from tether.training import train

    tmp = Path(tempfile.mkdtemp(prefix="tether-drift-"))
    tok = make_tokenizer()
    lm = make_tiny_llama(
        len(tok),
        hidden_size=64,
        intermediate_size=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    lm.save_pretrained(tmp / "start")
    tok.save_pretrained(tmp / "start")
    prompts = [f"the movie number {i} was" for i in range(60)] + [f"a film {i} that" for i in range(60)]
    (tmp / "prompts.txt").write_text("\n".join(prompts) + "\n")
    folders = {}
    for dtype, seed in (("float32", 0), ("bfloat16", 0), ("float32", 1)):
        out = tmp / f"{dtype}-{seed}"
        train(
            load_config(
                None,
                [
                    f"model.name={tmp / 'start'}",
                    f"model.dtype={dtype}",
                    f"train.seed={seed}",
                    f"train.algo={args.algo}",
                    f"train.steps={args.steps}",
                    f"data.prompts={tmp / 'prompts.txt'}",
                    "rollout.batch_size=16",
                    "rollout.max_new_tokens=12",
                    "optim.minibatch_size=8",
                    "optim.lr=1e-3",
                    "eval.n_prompts=0",
                    "eval.judge=none",
                    "train.checkpoint_every=0",
                    "train.progress=false",
                    "reward.scorer=tests.conftest:length_judge",
                    f"train.output_dir={out}",
                    *args.overrides,
                ],
            )
        )
        folders[f"{dtype}-{seed}"] = out / "policy"
    load = lambda f: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval()
    fp32, bf16, ref = load(folders["float32-0"]), load(folders["bfloat16-0"]), load(tmp / "start")
    other = load(folders["float32-1"])
    held = [f"a review {i} of the film" for i in range(64)]
    with torch.no_grad():
        ro = generate(fp32, tok, held, 12, 1.0, seeds=sample_seeds(1, 0, range(len(held))))
        z = {
            k: rollout_logprobs(m, ro, 1.0, keep_logits=True).logits
            for k, m in (("fp32", fp32), ("bf16", bf16), ("ref", ref), ("seed", other))
        }
    mask = ro.response_mask
    drift = float(masked_mean(exact_kl_from_logits(z["fp32"], z["bf16"]), mask))
    moved = float(masked_mean(exact_kl_from_logits(z["fp32"], z["ref"]), mask))
    seed_drift = float(masked_mean(exact_kl_from_logits(z["fp32"], z["seed"]), mask))
    print(f"{args.algo}, {args.steps} steps, tiny Llama (hidden 64, 2 blocks), lr 1e-3, batch 16")
    print(f"drift    KL(pi_fp32 || pi_bf16) = {drift:.3e} nats/token")
    print(f"movement KL(pi_fp32 || pi_ref)  = {moved:.3e} nats/token")
    print(f"seed drift KL(pi_fp32 || pi_fp32, seed 1) = {seed_drift:.3e} nats/token")
    print(f"drift / movement = {drift / moved:.3f}, drift / seed drift = {drift / seed_drift:.3f}")
    print(f"({int(mask.sum())} held-out tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
