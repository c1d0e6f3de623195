"""Operators per decoded token: what a GPU pays in kernel launches, counted on a CPU.

Usage: python benchmarks/launches.py [--rows 1 8 64] [--tokens 8 16]

On a GPU every torch operator of a decode step is (at least) one kernel launch, and launches,
not arithmetic, bound a small model's decoding. A sampler that loops over the rows of the batch
(one ``torch.rand`` per row, as tether's did before ``tether.core.noise``) adds B operators per
token; a vectorized one adds a constant. This script counts them on the examples' tiny random Llama (hidden
32, 2 blocks, ``examples/_tiny.py``; nothing downloaded) with ``torch.profiler``:
one ``tether.models.sampling.generate`` call of T1 and one of T2 decoded tokens at each batch size
(end tokens suppressed so every row decodes exactly T tokens), and

    operators per decoded token = (events(T2) - events(T1)) / (T2 - T1)

which cancels the prompt's prefill, tokenization and set-up. Two counts: every ``aten::`` event
(nested ones included: an ``aten::linear`` and the ``aten::addmm`` inside it count twice), and the
top-level ones only (what Python dispatched). Both should be the same at every batch size.

Prints numbers, never asserts. Run it at an older commit (a git worktree, ``PYTHONPATH`` at its
``src``) for the "before" column.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def tiny_model_and_tokenizer():
    """The examples' tiny random 2-block Llama and its BPE tokenizer (``examples/_tiny.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from _tiny import tiny_policy, tiny_tokenizer

    corpus = ["the movie was good and the acting was great", "a film about a dog and its friend"] * 20
    tok = tiny_tokenizer(corpus)
    return tiny_policy(tok), tok


def force_exact_length() -> None:
    """Every row decodes exactly max_new_tokens tokens (min_new_tokens in the config generate builds)."""
    import tether.models.sampling as sampling

    original = sampling.GenerationConfig

    def config(**kw):
        return original(min_new_tokens=kw["max_new_tokens"], **kw)

    sampling.GenerationConfig = config


def count_events(lm, tok, rows: int, tokens: int) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    from tether.models.sampling import generate

    prompts = ["the movie was"] * rows
    seeds = list(range(rows))
    generate(lm, tok, prompts, tokens, 1.0, seeds=seeds)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = generate(lm, tok, prompts, tokens, 1.0, seeds=seeds)
    assert out.response_ids.shape == (rows, tokens), out.response_ids.shape
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(events), len(top)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, nargs=2, default=[8, 16])
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    force_exact_length()
    lm, tok = tiny_model_and_tokenizer()
    t1, t2 = args.tokens
    print(f"tiny Llama, 2 blocks, vocabulary {len(tok)}; T1={t1}, T2={t2} decoded tokens")
    print("| rows | aten ops, T1 | aten ops, T2 | aten ops per token | top-level ops per token |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        all1, top1 = count_events(lm, tok, rows, t1)
        all2, top2 = count_events(lm, tok, rows, t2)
        per_all, per_top = (all2 - all1) / (t2 - t1), (top2 - top1) / (t2 - t1)
        print(f"| {rows} | {all1} | {all2} | {per_all:.1f} | {per_top:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
