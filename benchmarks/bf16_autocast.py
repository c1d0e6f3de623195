"""Does bf16 autocast pay on this CPU? Generation and the update's forward + backward, fp32 against bf16.

Usage: python benchmarks/bf16_autocast.py [--model smollm2-135m] [--completions 8] [--max-new-tokens 24]
                                         [--repeats 3]

Times, on the embedded default model, (a) sampling ``--completions`` x ``--max-new-tokens`` tokens and
(b) one forward + backward of the policy on those responses (the GRPO update's work), each in fp32
and under ``torch.autocast("cpu", dtype=torch.bfloat16)``, medians of ``--repeats``. It also prints
how far the bf16 log-probabilities are from the fp32 ones: the size of the sampler/learner mismatch
(and of the step-0 KL) that a bf16 path would bring if the reference or the old log-probs stayed
fp32. Prints the CPU flags that matter (avx512_bf16, amx_bf16). Prints numbers, never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_trl import force_min_new_tokens_in_tether  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from tether.data.prompts import movie_prompts
    from tether.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from tether.models.policy import PolicyWithValue
    from tether.models.sampling import generate
    from tether.models.scoring import rollout_logprobs

    flags = open("/proc/cpuinfo").read().split()
    print(
        f"CPU: avx512_bf16 {'avx512_bf16' in flags}, amx_bf16 {'amx_bf16' in flags}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    path = resolve_model_path(args.model)
    lm, tok = load_causal_lm(path), load_tokenizer(path)
    policy = PolicyWithValue(lm)
    prompts = movie_prompts(0, 2, 8, 0.05)[0][: args.completions]
    force_min_new_tokens_in_tether()  # exactly max_new_tokens tokens in every run: equal work
    seeds = list(range(args.completions))

    def timed(fn, bf16: bool):
        out, times = None, []
        for _ in range(args.repeats + 1):  # the first call warms up
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = fn()
            times.append(time.perf_counter() - t)
        return out, statistics.median(times[1:])

    def gen():
        with torch.no_grad():
            return generate(lm, tok, prompts, args.max_new_tokens, 1.0, seeds=seeds)

    ro, _ = timed(gen, False)

    def fwd_bwd():
        policy.zero_grad(set_to_none=True)
        lp = rollout_logprobs(policy, ro, 1.0).logprobs
        lp.float().sum().backward()
        return lp.detach().float()

    res = {}
    for bf16 in (False, True):
        _, g = timed(gen, bf16)
        lp, u = timed(fwd_bwd, bf16)
        res[bf16] = (g, u, lp)
    (g32, u32, lp32), (g16, u16, lp16) = res[False], res[True]
    diff = (lp16 - lp32).abs()
    print(
        f"generate {args.completions} x {args.max_new_tokens} tokens: fp32 {g32:.2f} s, bf16 autocast "
        f"{g16:.2f} s "
        f"(x{g32 / g16:.2f} speed)"
    )
    print(f"policy forward + backward: fp32 {u32:.2f} s, bf16 autocast {u16:.2f} s (x{u32 / u16:.2f} speed)")
    print(
        f"|log-prob bf16 - fp32|: mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f} nats per token; "
        f"summed over a response: mean {float(diff.sum(-1).mean()):.3f} nats"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
