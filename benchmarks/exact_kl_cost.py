"""What the exact full-vocabulary KL costs beside k3: scoring memory at two lengths, and step time.

Usage:
    python benchmarks/exact_kl_cost.py [--lengths 24 96] [--chunks 256 1024] [--rows 32]
                                       [--steps 5 --warmup 1] [--model smollm2-135m]

Part 1, scoring memory. For each response length R and LM-head slice size (``model.head_chunk_size``)
the no-grad scoring of B = ``--rows`` responses by the policy and the reference
(``tether.models.scoring.policy_and_reference_logprobs``) runs with the k3 estimator only, then with the
exact KL, and, for contrast, the way that holds both models' full (B, R, V) logits. The peak
resident memory above the level just before the call is sampled from ``/proc/self/statm`` every
millisecond; before each call ``malloc_trim`` hands freed memory back to the system, so the
level it starts from is the live memory, not what earlier calls left in glibc's free lists.

Part 2, step time. One PPO run on the default config whose steps alternate ``kl.exact`` off and
on (the same model, prompts and batch; the trainer reads the flag each step), medians over
``--steps`` steps of each after ``--warmup`` steps.

Prints numbers, never asserts (not part of the test suite).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Highest resident size seen while the block runs, minus the size when it began (bytes)."""

    def __enter__(self):
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: base = live memory
        self.base = self.peak = rss_bytes()
        self.stop = False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.extra = self.peak - self.base


def scoring_memory(args) -> None:
    import torch

    from tether.core.kl import exact_kl_from_logits
    from tether.core.logprobs import logprobs_from_logits
    from tether.models.loading import load_causal_lm, resolve_model_path
    from tether.models.policy import PolicyWithValue
    from tether.models.reference import make_reference
    from tether.models.sampling import Rollout
    from tether.models.scoring import policy_and_reference_logprobs, response_forward

    lm = load_causal_lm(resolve_model_path(args.model))
    reference = make_reference(lm)
    V = lm.get_output_embeddings().weight.shape[0]
    B, P = args.rows, 8
    print(
        f"## scoring memory: {B} responses, prompt {P} tokens, vocabulary {V}, float32, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "| R | chunk | k3 only: MB, s | exact KL: MB, s | exact - k3 MB | full (B,R,V) logits way: MB | "
        "B*R*V*4 MB |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for R in args.lengths:
        ids = torch.randint(0, V, (B, R), generator=g)
        ro = Rollout(
            ["x"] * B,
            torch.randint(0, V, (B, P), generator=g),
            prompt_mask=torch.ones(B, P, dtype=torch.long),
            response_ids=ids,
            response_mask=torch.ones(B, R, dtype=torch.bool),
            responses=[""] * B,
        )
        for chunk in args.chunks:
            policy = PolicyWithValue(lm, head_chunk=chunk)
            res = {}
            for mode in ("k3", "exact", "full"):
                runs = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    with PeakRSS() as m, torch.no_grad():
                        if mode == "full":  # both models' full logits held, then the exact KL
                            logits, _ = response_forward(policy, ro)
                            ref_logits, _ = response_forward(reference, ro, head_chunk=chunk)
                            logprobs_from_logits(logits, ids)
                            logprobs_from_logits(ref_logits, ids)
                            exact_kl_from_logits(logits, ref_logits, 1.0, chunk)
                            del logits, ref_logits
                        else:
                            policy_and_reference_logprobs(
                                policy, reference, ro, 1.0, exact_kl=mode == "exact", kl_chunk_size=chunk
                            )
                    runs.append((m.extra / 2**20, time.perf_counter() - t))
                res[mode] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
            print(
                f"| {R} | {chunk} | {res['k3'][0]:.0f}, {res['k3'][1]:.2f} | {res['exact'][0]:.0f}, "
                f"{res['exact'][1]:.2f} | {res['exact'][0] - res['k3'][0]:+.0f} | {res['full'][0]:.0f} | "
                f"{B * R * V * 4 / 2**20:.0f} |",
                flush=True,
            )


def step_time(args) -> None:
    import torch

    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.trainers.ppo import PPOTrainer

    out = tempfile.mkdtemp(prefix="tether-exact-kl-")
    config = load_config(
        None,
        [
            f"model.name={args.model}",
            "eval.n_prompts=0",
            "eval.every=0",
            "train.save_model=false",
            "train.checkpoint_every=0",
            "train.progress=false",
            f"train.output_dir={out}",
            *args.overrides,
        ],
    )
    run = build_run(config)
    trainer = PPOTrainer(run)
    times = {False: [], True: []}
    for step in range(args.warmup + 2 * args.steps):
        config.kl.exact = bool(step % 2)
        row = trainer.step(step)
        if step >= args.warmup:
            times[config.kl.exact].append(row["time/step"])
        print(f"  step {step}: kl.exact={config.kl.exact} {row['time/step']:.2f} s", file=sys.stderr)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    c = config
    print(
        f"## step time: PPO, batch {c.rollout.batch_size} x {c.rollout.max_new_tokens} tokens, "
        f"{torch.get_num_threads()} threads, medians of {args.steps} steps each (alternating)"
    )
    print(f"k3 only {off:.2f} s, with the exact KL {on:.2f} s: +{100 * (on / off - 1):.1f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[24, 96])
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="measured steps of each kind (0: skip part 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="config overrides for part 2, e.g. rollout.batch_size=16")
    args = ap.parse_args()
    scoring_memory(args)
    if args.steps:
        step_time(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
