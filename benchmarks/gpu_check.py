"""The GPU check: tether on one CUDA GPU, offline, in under 5 minutes.

Usage (from the repository root, on a machine with a CUDA GPU; nothing is downloaded)::

    PYTHONPATH=src python benchmarks/gpu_check.py [--steps 3] [--batch 64] [--new-tokens 128]

1. Runs the device-parametrized tests (``pytest -m device``) on ``cuda``
   (``TETHER_TEST_DEVICES=cuda``): device plumbing, bf16 step-0 exactness for PPO, GRPO, RLOO
   and DPO, gradient checkpointing, the sampler's log-probs against the learner's.
2. Builds a random-init Qwen2-shaped model of the 0.5B layout (24 blocks, hidden 896, 14 heads,
   2 key/value heads, MLP 4864) with the test fixtures' tokenizer (its vocabulary is 300 tokens,
   so the LM head is small; the trunk is the 0.5B one), saved to a temporary folder.
3. Runs ``--steps`` PPO and ``--steps`` GRPO steps in bf16 on it and prints, per trainer: the
   step-0 KL (estimator and exact) and first ratio deviation (must be 0.0 and 0.0),
   ``rollout/logprob_mismatch``, the step-time split (generate, score, update), generated tokens
   per second and peak GPU memory.

Prints numbers; exits 1 if a test fails or step 0 is not exact. Paste the output into
docs/performance.md ("GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def run_device_tests() -> int:
    env = {**os.environ, "TETHER_TEST_DEVICES": "cuda", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "device", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    print(f"## device tests on cuda ({time.perf_counter() - t0:.0f} s, exit {proc.returncode})\n{tail}")
    if proc.returncode:
        print(proc.stderr[-3000:])
    return proc.returncode


def build_model(folder: Path, layers: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"## model: random Qwen2 layout, {n / 1e6:.0f}M parameters, vocabulary {len(tok)}")


def run_trainer(algo: str, folder: Path, prompts: Path, args) -> bool:
    import torch

    from tether.run.config import load_config
    from tether.training import train

    out = Path(tempfile.mkdtemp(prefix=f"tether-gpu-{algo}-")) / "run"
    overrides = [
        f"model.name={folder}",
        "model.dtype=bfloat16",
        f"train.device={args.device}",
        f"train.algo={algo}",
        f"train.steps={args.steps}",
        f"data.prompts={prompts}",
        f"rollout.batch_size={args.batch}",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"optim.minibatch_size={args.batch // 2}",
        "kl.exact=true",
        "eval.n_prompts=0",
        "eval.judge=none",
        "train.save_model=false",
        "train.checkpoint_every=0",
        "train.progress=false",
        "reward.scorer=tests.conftest:length_judge",
        f"train.output_dir={out}",
    ]
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train(load_config(None, overrides))
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    exact = (
        first["objective/kl"] == 0.0
        and first["objective/kl_exact"] == 0.0
        and first["policy/ratio_max_dev_first"] == 0.0
    )
    print(f"## {algo}: {args.steps} steps, batch {args.batch}, up to {args.new_tokens} new tokens, bf16")
    verdict = "EXACT" if exact else "NOT EXACT"
    keys = ("objective/kl", "objective/kl_exact", "policy/ratio_max_dev_first")
    print("step 0: " + ", ".join(f"{k} {first[k]!r}" for k in keys) + f" -> {verdict}")
    print("step | generate s | score s | update s | tokens/s | logprob_mismatch | kl_exact/token")
    for r in rows:
        tokens = r["response/length"] * args.batch
        times = f"{r['time/generate']:10.2f} | {r['time/score']:7.2f} | {r['time/update']:8.2f}"
        print(
            f"{r['step']:4d} | {times} | {tokens / r['time/generate']:8.0f} | "
            f"{r['rollout/logprob_mismatch']:.3e} | {r['objective/kl_exact_per_token']:.3e}"
        )
    memory = (
        f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
        f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved; "
        if cuda
        else ""
    )
    print(f"{memory}wall {wall:.0f} s")
    return exact


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=24, help="transformer blocks (24: the 0.5B layout)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script itself"
    )
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (CI never runs it)")
        return 2
    if args.device == "cuda":
        print(
            f"## {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"bf16 {torch.cuda.is_bf16_supported()}"
        )
    failed = 0 if args.skip_tests else run_device_tests()
    with tempfile.TemporaryDirectory(prefix="tether-gpu-") as tmp:
        folder = Path(tmp) / "model"
        build_model(folder, args.layers)
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("".join(f"the movie number {i} was\n" for i in range(256)))
        exact = [run_trainer(algo, folder, prompts, args) for algo in ("ppo", "grpo")]
    return 1 if failed or not all(exact) else 0


if __name__ == "__main__":
    raise SystemExit(main())
