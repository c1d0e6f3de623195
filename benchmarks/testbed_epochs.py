"""GRPO's KL in the loss over the update's epochs: k3+ against k3_is on the tabular test bed.

Usage: python benchmarks/testbed_epochs.py [--seeds 5] [--sequence] [--scale-kl]

The default run takes 2 epochs of minibatches over each batch; after the first gradient step the
samples are those of pi_old. k3+ differentiates ``k1 grad log pi`` unweighted (biased there),
k3_is weighs it by ``pi / pi_old`` (exact). On the 4-action bandit of tests/oracle/test_testbed.py
(pi_ref (0.4, 0.3, 0.2, 0.1), rewards 0..3, beta 1, G = 64, GRPO as a default run places it: KL in
the loss, std-scaled advantages; 100 batches of 1024, cosine learning rate) this prints, per
learning rate and surrogate, over ``--seeds`` seeds (min - max):

* how far off-policy the second epoch is: the exact KL(pi_old || pi) at its first gradient step,
  mean over the first 10 batches;
* the surrogate's expected KL-gradient error there, |E_old[grad L] - grad KL| / |grad KL| (exact:
  k3+'s E_old[k1 grad log pi]; 0 for k3_is, with k3+'s on the same policies in brackets);
* the path: the mean exact KL(pi_t || fixed point) of the sampling policies of batches 10-49,
  and the first batch t with KL(pi_t || fixed point) < 1e-3;
* the end: KL(averaged policy || fixed point), the fixed point by enumerating the 47905 outcomes of
  a group (``tb.group_fixed_point(bed, 1, 64, "grpo")``).

``--sequence`` adds the 3-token bed (Dr. GRPO, its per-token fixed point, 150 batches), where the
table has 31 rows and the sampling noise of each is larger. Table in docs/kl.md ("The KL in the
loss off-policy"). ``--scale-kl`` adds ``grpo.scale_kl_by_std`` at G = 64 on the same bandit
(150 batches of 4096, the default surrogate): each seed's distance to its exact fixed point and
to Dr. GRPO's pi*(beta G / (G - 1)) (docs/kl.md, "scale_kl_by_std: the fixed point"). One thread,
seconds per run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tether.testing import testbed as tb  # noqa: E402

F64 = torch.float64
LRS = [(0.05, 2), (0.2, 2), (0.5, 2), (1.0, 4)]  # (lr, epochs); the bed's lr is 0.05


def k3_plus_error(old: torch.Tensor, now: torch.Tensor, ref: torch.Tensor) -> float:
    """|E_old[k1 grad log pi] - grad KL(pi || pi_ref)| / |grad KL| on a bandit, in logit space."""
    pi, k1 = now.exp(), now - ref
    true = pi * (k1 - (pi * k1).sum())
    k3_plus = old.exp() * k1 - pi * (old.exp() * k1).sum()
    return float((k3_plus - true).norm() / true.norm())


def span(xs: list[float], fmt: str = "{:.1e}") -> str:
    return f"{fmt.format(min(xs))} - {fmt.format(max(xs))}"


def bandit_table(seeds: int) -> None:
    bed = tb.bandit([0.4, 0.3, 0.2, 0.1], [0.0, 1.0, 2.0, 3.0])
    fp = tb.group_fixed_point(bed, 1.0, 64, "grpo")[0]
    ref = torch.log_softmax(bed.ref_logits[0].to(F64), -1)
    print(
        "| lr, epochs | surrogate | KL(pi_old || pi), 2nd epoch | its KL-gradient error there "
        "| mean KL(pi_t || fp), t = 10-49 | first t < 1e-3 | final KL(pi || fp) |"
    )
    print("|---|---|---|---|---|---|---|")
    for lr, epochs in LRS:
        for est in ("k3+", "k3_is"):
            rows = []
            for seed in range(seeds):
                s = tb.TrainSettings(
                    steps=100, batch_size=1024, group_size=64, lr=lr, epochs=epochs, seed=seed
                )
                log = tb.train_group(bed, "grpo", 1.0, s, loss_estimator=est)
                per = epochs * s.minibatches
                steps = [lp[0] for lp in log.step_logprobs]
                path = [float(tb.exact_kl(p, fp)) for p in steps[::per]]
                pairs = [(steps[b * per], steps[b * per + s.minibatches]) for b in range(10)]
                rows.append(
                    (
                        statistics.mean(float(tb.exact_kl(a, b)) for a, b in pairs),
                        statistics.mean(k3_plus_error(a, b, ref) for a, b in pairs),
                        statistics.mean(path[10:50]),
                        next((t for t, d in enumerate(path) if d < 1e-3), None),
                        tb.kl_to(log.table, bed, fp),
                    )
                )
            off, err, path_mean, first, final = zip(*rows)
            # k3_is's expected gradient is exact (tests/oracle/test_kl_placement.py); in brackets
            # what k3+'s would be on that run's own policies
            error = span(err, "{:.1%}") if est == "k3+" else f"0 (k3+: {span(err, '{:.1%}')})"
            print(
                f"| {lr}, {epochs} | {est} | {span(off)} | {error} | {span(path_mean)} "
                f"| {', '.join(str(t) for t in first)} | {span(final)} |",
                flush=True,
            )


def sequence_table(seeds: int) -> None:
    bed = tb.random_sequence_bed(seed=0, reward_scale=2.0)
    G = 64
    fixed = tb.sequence_logprobs(tb.per_token_kl_in_loss_fixed_point(bed, 0.5, (G - 1) / G), 5, 3)
    print("\n3-token bed, Dr. GRPO (per-token fixed point), 150 batches of 1024:")
    for lr in (0.05, 0.2):
        for est in ("k3+", "k3_is"):
            rows = []
            for seed in range(seeds):
                s = tb.TrainSettings(steps=150, batch_size=1024, group_size=G, lr=lr, seed=seed)
                log = tb.train_group(bed, "grpo", 0.5, s, loss_estimator=est, scale_by_std=False)
                per = s.epochs * s.minibatches
                path = [tb.kl_to(lp, bed, fixed) for lp in log.step_logprobs[::per]]
                rows.append((statistics.mean(path[10:75]), tb.kl_to(log.table, bed, fixed)))
            path_mean, final = zip(*rows)
            print(f"  lr {lr} {est}: mean KL(pi_t || fp), t = 10-74: {span(path_mean)}; final {span(final)}")


def scale_kl_runs(seeds: int) -> None:
    bed = tb.bandit([0.4, 0.3, 0.2, 0.1], [0.0, 1.0, 2.0, 3.0])
    G = 64
    fp = tb.group_fixed_point(bed, 1.0, G, "grpo-scale-kl")[0]
    ref = tb.sequence_logprobs(bed.ref_logits, 4, 1)
    dr_grpo = tb.optimal_logprobs(ref, bed.rewards, G / (G - 1))
    print(
        f"\ngrpo.scale_kl_by_std, G = {G}, 150 batches of 4096; KL(fp || pi*(bG/(G-1))) = "
        f"{float(tb.exact_kl(fp, dr_grpo)):.2e}"
    )
    for seed in range(seeds):
        s = tb.TrainSettings(steps=150, batch_size=4096, group_size=G, seed=seed)
        log = tb.train_group(bed, "grpo", 1.0, s, scale_by_std=True, scale_kl_by_std=True)
        print(
            f"  seed {seed}: KL(pi || fp) {tb.kl_to(log.table, bed, fp):.2e}, "
            f"KL(pi || pi*(bG/(G-1))) {tb.kl_to(log.table, bed, dr_grpo):.2e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--sequence", action="store_true", help="also the 3-token bed")
    ap.add_argument("--scale-kl", action="store_true", help="also grpo.scale_kl_by_std at G = 64")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bandit_table(args.seeds)
    if args.sequence:
        sequence_table(args.seeds)
    if args.scale_kl:
        scale_kl_runs(args.seeds)


if __name__ == "__main__":
    main()
