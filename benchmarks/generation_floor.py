"""What bounds generation on this CPU: the decode step's matrix products, and what might beat them.

Usage: python benchmarks/generation_floor.py [--model smollm2-135m] [--rows 8] [--tokens 24] [--rounds 5]
       [--compile]
       [--profile]
       python benchmarks/generation_floor.py --floor [--floor-rows 1 8 32 64] [--rounds 3] [--compiled]
       [--bf16]

Prints, for the embedded default model (fp32):

1. the time per generated token of every linear layer of the model (attention and MLP
   projections and the LM head, each weight read once per token, as in a decode step) at
   M = 1 .. 64 rows, and at ``--rows`` rows for the alternatives: bf16 copies of the weights
   (the memory traffic halved; not what tether samples from), oneDNN's linear on the fp32 weights
   (a private torch op), and MKL-packed fp32 weights;
2. one ``tether.models.sampling.generate`` call of ``--rows`` x ``--tokens`` tokens (transformers'
   dynamic cache) against a static cache, against MKL-packed weights in the decode steps
   (packed at every call, as a trained policy's changing weights would need), and with
   ``--compile`` a static cache under
   ``torch.compile`` (compile time printed apart; transformers' own ``compile_config`` is skipped
   on CPU, so the model's forward is compiled directly);
3. with ``--profile``, where one ``generate`` call's time goes: torch profiler's self CPU time
   per operator (the matrix products, attention, the cache's concatenations, the sampler's noise)
   as shares of the call, the rest being Python and dispatch.

``--floor`` prints instead the decode step against its memory-bandwidth floor: the machine's read
bandwidth (``torch.sum`` over a 1 GiB fp32 tensor, far past every cache: what streaming the
weights costs), the floor per decoded token (every weight read once per token: the bytes of all
linear weights, the LM head included, over that bandwidth; the embedding lookup reads only B
rows), and ``generate`` at each of ``--floor-rows`` rows, timed at two lengths so that prompt
prefill and set-up cancel: ms per decoded token = (t(T2) - t(T1)) / (T2 - T1), tokens/s = rows
over that, and its ratio to the floor (1.0 would be the bandwidth bound; above it, the matrix
products are compute- or latency-bound, or time goes outside them). With ``--compiled`` each row
count is timed a second time with ``rollout.compile``'s decoding (``generate(..., compiled=True)``:
a static cache and the decode step under ``torch.compile``; compiled before timing, compile time
printed apart), in turn with the eager calls, and the ratio compiled / eager printed.
With ``--bf16`` each row count is also timed on ``rollout.dtype=bf16``'s sampler, the bfloat16
copy of the model (:class:`tether.models.rollouts.SamplerCopy`; compiled too with ``--compiled``),
with the ratio fp32 / bf16 and the exact KL(bf16 sampler || fp32 learner) per decoded token (and
its largest), from a rollout scored as the trainers score it.

The variants of each table run in turn, ``--rounds`` times; medians are printed, so a drift in
the machine's speed (large on this shared 2-core machine) hits every variant alike.

Prints numbers, never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def per_token_ms(weights, fn, rows: int, dtype, repeats: int = 4) -> float:
    import torch

    xs = {k: torch.randn(rows, k, dtype=dtype) for k in {w.shape[-1] for w in weights}}
    with torch.no_grad():
        for w in weights:  # warm-up pass
            fn(xs[w.shape[-1]], w)
        t = time.perf_counter()
        for _ in range(repeats):
            for w in weights:
                fn(xs[w.shape[-1]], w)
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--floor-rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--floor-tokens", type=int, nargs=2, default=[8, 24])
    ap.add_argument("--compiled", action="store_true", help="--floor: also time rollout.compile's decoding")
    ap.add_argument("--bf16", action="store_true", help="--floor: also time rollout.dtype=bf16's decoding")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import StaticCache

    from tether.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from tether.models.sampling import generate

    path = resolve_model_path(args.model)
    lm, tok = load_causal_lm(path), load_tokenizer(path)
    weights = [m.weight.detach() for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    mb = sum(w.numel() * 4 for w in weights) / 2**20
    print(
        f"{len(weights)} linear weights, {mb:.0f} MB fp32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    if args.floor:
        return bandwidth_floor(lm, tok, weights, args)
    print("\n| rows M | fp32 linear ms/token | GB/s of weights |\n|---|---|---|")
    for m in (1, 2, 4, 8, 16, 32, 64):
        ms = per_token_ms(weights, F.linear, m, torch.float32)
        print(f"| {m} | {ms:.1f} | {mb / 1024 / ms * 1e3:.1f} |", flush=True)

    M = args.rows
    variants = {"fp32 F.linear": (weights, F.linear, torch.float32)}
    variants["bf16 copies of the weights, F.linear"] = (
        [w.to(torch.bfloat16) for w in weights],
        F.linear,
        torch.bfloat16,
    )
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        variants["fp32, oneDNN linear (torch.ops.mkldnn._linear_pointwise)"] = (
            weights,
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            torch.float32,
        )
    if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        packed = {id(w): torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in weights}
        variants["fp32, MKL-packed weights (torch.ops.mkl._mkl_linear)"] = (
            weights,
            lambda x, w: torch.ops.mkl._mkl_linear(x, packed[id(w)], w, None, M),
            torch.float32,
        )
    # rounds of every variant in turn: drift in the machine's speed hits all of them
    seen: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, (ws, fn, dtype) in variants.items():
            seen[name].append(per_token_ms(ws, fn, M, dtype, repeats=2))
    base = statistics.median(seen["fp32 F.linear"])
    print(
        f"\n| M = {M}: variant | ms/token (median of {args.rounds} rounds) | x fp32 F.linear |\n|---|---|---|"
    )
    for name, ts in seen.items():
        print(f"| {name} | {statistics.median(ts):.1f} | {statistics.median(ts) / base:.2f} |", flush=True)
    del variants

    sys.path.insert(0, str(Path(__file__).parent))
    import compare_trl

    compare_trl.force_min_new_tokens_in_tether()  # exactly --tokens tokens, as in compare_trl.py
    prompts = ["The gorgeously elaborate continuation of"] * M
    eager_forward, plain_generate = lm.forward, lm.generate

    def static_generate(*a, **kw):
        kw["past_key_values"] = StaticCache(config=lm.config, max_cache_len=64 + args.tokens)
        return plain_generate(*a, **kw)

    linears = [m for m in lm.modules() if isinstance(m, torch.nn.Linear)]

    def packed_decode():
        """MKL-packed weights in every decode step's linears (packing, once per call, included)."""
        packed = {m: torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), M) for m in linears}

        def forward(m, x):
            if x.dim() == 3 and x.shape[:2] == (M, 1):
                return torch.ops.mkl._mkl_linear(x.reshape(M, -1), packed[m], m.weight, m.bias, M).unsqueeze(
                    1
                )
            return F.linear(x, m.weight, m.bias)

        for m in linears:
            m.forward = forward.__get__(m)
        try:
            generate(lm, tok, prompts, args.tokens, 1.0, seeds=range(M))
        finally:
            for m in linears:
                del m.forward

    def one(mode: str) -> float:
        lm.forward = compiled if mode == "static cache + torch.compile" else eager_forward
        lm.generate = static_generate if mode.startswith("static") else plain_generate
        t = time.perf_counter()
        if mode.startswith("dynamic cache, MKL-packed"):
            packed_decode()
        else:
            generate(lm, tok, prompts, args.tokens, 1.0, seeds=range(M))
        return time.perf_counter() - t

    modes = ["dynamic cache (transformers' default)", "static cache"]
    if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        modes.append("dynamic cache, MKL-packed decode weights (packing included)")
    compile_s = None
    if args.compile:
        compiled = torch.compile(eager_forward, dynamic=False)
        modes.append("static cache + torch.compile")
        compile_s = one(modes[-1])
    gen = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            gen[m].append(one(m))
    print(f"\n| generate {M} x {args.tokens} tokens | median s of {args.rounds} rounds |\n|---|---|")
    for m, ts in gen.items():
        print(f"| {m} | {statistics.median(ts):.2f} |")
    if compile_s is not None:
        print(f"\nfirst compiled call (compiling included): {compile_s:.0f} s")
    if args.profile:
        profile_generate(lambda: one("dynamic cache (transformers' default)"))
    return 0


def read_bandwidth_gbs(rounds: int) -> float:
    """GB/s (2^30 bytes) of reading a 1 GiB fp32 tensor once (``torch.sum``), median of ``rounds``."""
    import torch

    x = torch.ones(2**28)
    x.sum()
    seen = []
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        seen.append(1.0 / (time.perf_counter() - t))
    return statistics.median(seen)


def bandwidth_floor(lm, tok, weights, args) -> int:
    """The --floor table: generate's ms per decoded token at each row count against the floor."""
    sys.path.insert(0, str(Path(__file__).parent))
    import compare_trl
    from tether.models.sampling import generate

    compare_trl.force_min_new_tokens_in_tether()  # every row decodes exactly the tokens asked
    gib = sum(w.numel() * w.element_size() for w in weights) / 2**30
    bw = read_bandwidth_gbs(args.rounds * 3)
    floor_ms = gib / bw * 1e3
    print(
        f"read bandwidth {bw:.1f} GB/s; weights streamed per token {gib * 1024:.0f} MB; "
        f"floor {floor_ms:.1f} ms/token"
    )
    t1, t2 = args.floor_tokens
    modes: list = [False, True] if args.compiled else [False]
    copy = None
    if args.bf16:  # rollout.dtype=bf16: the sampler's copy, as the trainers build it
        from tether.models.rollouts import SamplerCopy

        copy = SamplerCopy().of(lm)
        modes += ["bf16"] + (["bf16 compiled"] if args.compiled else [])
    head = f"| rows | ms per decoded token (median of {args.rounds}) | tokens/s | x floor | GB/s of weights |"
    if args.compiled:
        head += " compiled ms/token | tokens/s | x floor | compiled / eager | compile s |"
    if args.bf16:
        head += " bf16 ms/token | tokens/s | fp32 / bf16 | sampler KL nats/token (max) |"
        if args.compiled:
            head += " bf16 compiled ms/token | fp32 eager / bf16 compiled |"
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    for rows in args.floor_rows:
        prompts = ["The gorgeously elaborate continuation of"] * rows

        def timed(n: int, compiled, prompts=prompts) -> float:
            t = time.perf_counter()
            rows = len(prompts)
            model = copy if isinstance(compiled, str) else lm  # "bf16", "bf16 compiled": the copy
            fused = compiled is True or compiled == "bf16 compiled"
            generate(model, tok, prompts, n, 1.0, seeds=range(rows), max_prompt_tokens=16, compiled=fused)
            return time.perf_counter() - t

        compile_s = 0.0
        for compiled in modes:  # warm-up: each length once (compiled: one graph per cache length)
            for n in (t1, t2):
                first = timed(n, compiled)
                compile_s += first - timed(n, compiled) if compiled is True else 0.0
        per: dict = {m: [] for m in modes}
        for _ in range(args.rounds):
            for compiled in modes:
                per[compiled].append((timed(t2, compiled) - timed(t1, compiled)) / (t2 - t1))
        ms = {m: statistics.median(v) * 1e3 for m, v in per.items()}
        line = f"| {rows} | {ms[False]:.1f} | {rows / ms[False] * 1e3:.0f} | {ms[False] / floor_ms:.2f} | "
        line += f"{gib / ms[False] * 1e3:.1f} |"
        if args.compiled:
            line += f" {ms[True]:.1f} | {rows / ms[True] * 1e3:.0f} | {ms[True] / floor_ms:.2f} | "
            line += f"{ms[True] / ms[False]:.2f} | {compile_s:.0f} |"
        if args.bf16:
            kl, worst = sampler_kl(lm, copy, tok, prompts, t2)
            line += f" {ms['bf16']:.1f} | {rows / ms['bf16'] * 1e3:.0f} | {ms[False] / ms['bf16']:.2f} | "
            line += f"{kl:.2e} ({worst:.2e}) |"
            if args.compiled:
                line += f" {ms['bf16 compiled']:.1f} | {ms[False] / ms['bf16 compiled']:.2f} |"
        print(line, flush=True)
    return 0


def sampler_kl(lm, copy, tok, prompts, tokens: int) -> tuple[float, float]:
    """The exact KL(bf16 sampler || fp32 learner) per decoded token (mean over the valid ones, and
    the largest), nats: a rollout of the copy with its logits kept, scored by the learner as the
    trainers score it (:func:`tether.trainers.common.old_and_ref_logprobs`)."""
    import torch

    from tether.models.policy import PolicyWithValue
    from tether.models.sampling import generate
    from tether.trainers.common import old_and_ref_logprobs

    rollout = generate(copy, tok, prompts, tokens, 1.0, seeds=range(len(prompts)), keep_logits=True)
    policy = PolicyWithValue(lm)
    rows = [torch.arange(len(prompts))]
    out = old_and_ref_logprobs(policy, None, rollout, 1.0, rows, with_values=False, exact_kl=False)
    mask = rollout.response_mask
    kl = out.sampler_kl[mask]
    return float(kl.mean()), float(kl.max())


def profile_generate(call) -> None:
    """Print the operators taking most of one generate call, as shares of its wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = call()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\n| generate, profiled ({wall:.2f} s wall) | self CPU s | share of wall |\n|---|---|---|")
    for e in ops[:8]:
        s = e.self_cpu_time_total / 1e6
        print(f"| {e.key} ({e.count} calls) | {s:.3f} | {s / wall:.0%} |")
    rest = wall - sum(e.self_cpu_time_total for e in ops) / 1e6
    print(f"| outside any operator (Python, transformers' generate loop) | {rest:.3f} | {rest / wall:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
