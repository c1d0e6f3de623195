"""Data parallelism: global reductions over real gloo ranks, shard-invariant sampling, 1 vs 2 processes.

Everything runs on the CPU: ranks are processes joined by torch.distributed's gloo backend
(torch.multiprocessing for the reductions, ``accelerate launch`` for the end-to-end runs).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import TINY_RUN, make_tiny_llama, metric_rows, tiny_run_args
from tether.core import distributed as D
from tether.core.advantages import WHITEN_EPS
from tether.core.masked import masked_mean
from tether.core.noise import gumbel_noise
from tether.models.sampling import Rollout, can_compile, generate, sample_seeds
from tether.run.config import ConfigError, check_world_size, load_config

REPO = Path(__file__).resolve().parents[2]

# ---- (a) reductions over four real gloo ranks -------------------------------------------------
# Per-token KL on each rank of a batch split four ways: rank 0 has two valid tokens, rank 2 one,
# ranks 1 and 3 none (their slots hold garbage, even NaN, that must never count).
FOUR_KL = {0: [[1.0, 1.0]], 1: [[5.0, float("nan")]], 2: [[1.0, 9.0]], 3: [[3.0, 3.0]]}
FOUR_MASK = {0: [[True, True]], 1: [[False, False]], 2: [[True, False]], 3: [[False, False]]}


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (values (3, 5), mask (3, 5), scores (3,)) of one rank; rank 3 has no valid token."""
    g = torch.Generator().manual_seed(100 + rank)
    values = torch.randn(3, 5, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, 6, (3,), generator=g) if rank != 3 else torch.zeros(3, dtype=torch.long)
    mask = torch.arange(5)[None, :] < lengths[:, None]
    return values, mask, torch.randn(3, generator=g, dtype=torch.float64)


def _four_ranks(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from tether.trainers.base import sample_metrics
        from tether.trainers.common import RolloutLogprobs

        kl, mask = torch.tensor(FOUR_KL[rank]), torch.tensor(FOUR_MASK[rank])
        ids = torch.zeros(1, 2, dtype=torch.long)
        ro = Rollout(
            ["p"],
            ids[:, :1],
            prompt_mask=torch.ones(1, 1, dtype=torch.long),
            response_ids=ids,
            response_mask=mask,
            responses=["r"],
        )
        zeros = torch.zeros(1, 2)
        learner = RolloutLogprobs(zeros, None, values=None, entropy=zeros, exact_kl=None)
        row = sample_metrics(ro, torch.tensor([0.5]), kl=kl, forwards=learner, kl_coef=0.1, estimator="k1")
        values, vmask, scores = _rank_data(rank)
        out = {
            "rank": D.rank(),
            "world": D.world_size(),
            "kl_per_token": float(row["objective/kl_per_token"]),
            "token_mean": float(D.token_mean(kl, mask)),
            "whiten": D.whiten(values, vmask).tolist(),
            "token_mean_random": float(D.token_mean(values, vmask)),
            "sequence_mean": float(D.sequence_mean(scores)),
            "sequence_std": float(D.sequence_std(scores)),
            "share": float(D.token_shares([vmask])[0]),
            "explained_variance": float(D.explained_variance(values, values.flip(-1) * 0.5 + values, vmask)),
            "max": float(D.all_reduce_max(torch.tensor(float(rank)))),
            "min": float(D.all_reduce_min(torch.tensor(float(rank)))),
        }
        Path(out_dir, f"{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_four_gloo_ranks_reduce_token_weighted(tmp_path):
    world = 4
    mp.spawn(_four_ranks, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in res] == [0, 1, 2, 3] and {r["world"] for r in res} == {4}
    # tokens [1, 1] + [1] over the ranks that have any: (1 + 1 + 1) / 3 = 1.0, on every rank.
    # The mean of the four rank means would be (1 + 0 + 1 + 0) / 4 = 0.5.
    for r in res:
        assert r["kl_per_token"] == 1.0 and r["token_mean"] == 1.0
    # the same reductions equal the single-process statistics of the concatenated batch
    parts = [_rank_data(r) for r in range(world)]
    values = torch.cat([p[0] for p in parts])
    mask = torch.cat([p[1] for p in parts])
    scores = torch.cat([p[2] for p in parts])
    want_whiten = D.whiten(values, mask)  # one process: the whole batch's statistics
    for r in res:
        assert r["token_mean_random"] == pytest.approx(float(masked_mean(values, mask)), rel=1e-12)
        assert r["sequence_mean"] == pytest.approx(float(scores.mean()), rel=1e-12)
        assert r["sequence_std"] == pytest.approx(float(scores.std()), rel=1e-12)
        assert r["max"] == 3.0 and r["min"] == 0.0
    got_whiten = torch.cat([torch.tensor(r["whiten"], dtype=torch.float64) for r in res])
    torch.testing.assert_close(got_whiten, want_whiten, rtol=1e-10, atol=1e-12)
    returns = values.flip(-1) * 0.5 + values
    valid = mask.bool()
    want_ev = 1 - float((returns - values)[valid].var() / returns[valid].var())
    for r in res:
        assert r["explained_variance"] == pytest.approx(want_ev, rel=1e-10)
    shares = [r["share"] for r in res]
    assert shares[3] == 0.0 and sum(shares) == pytest.approx(1.0, abs=1e-6)


def test_reductions_without_a_process_group_are_the_batch_statistics():
    values, mask, scores = _rank_data(0)
    assert D.world_size() == 1 and D.rank() == 0 and D.is_main()
    assert float(D.token_mean(values, mask)) == pytest.approx(float(masked_mean(values, mask)), rel=1e-12)
    assert float(D.sequence_std(scores)) == pytest.approx(float(scores.std()), rel=1e-12)
    valid = values[mask]  # the formula by hand: (x - mean) / sqrt(unbiased var + WHITEN_EPS)
    by_hand = torch.where(mask, (values - valid.mean()) / (valid.var() + WHITEN_EPS).sqrt(), 0.0)
    torch.testing.assert_close(D.whiten(values, mask), by_hand, rtol=1e-12, atol=1e-12)
    assert float(D.token_shares([mask])[0]) == 1.0 and D.gather_objects("x") == ["x"]


def test_explained_variance_hand_values():
    # valid returns 2, 2, 4: mean 8/3, variance (2 * 4/9 + 16/9) / 3 = 8/9;
    # returns - values 1, 0, 1: mean 2/3, variance (2 * 1/9 + 4/9) / 3 = 2/9; 1 - (2/9) / (8/9) = 0.75.
    # Masked slots hold values that would change both variances if they counted.
    values = torch.tensor([[1.0, 2.0, 50.0], [3.0, -7.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(D.explained_variance(values, returns, mask)) == pytest.approx(0.75, rel=1e-12)
    assert float(D.explained_variance(returns, returns, mask)) == 1.0  # a perfect value head
    flat = torch.full_like(returns, 3.0)
    assert math.isnan(float(D.explained_variance(values, flat, mask)))  # returns that do not vary


@pytest.mark.parametrize("world", [2, 4])
def test_minibatches_do_not_depend_on_the_number_of_processes(world):
    B, mb = 16, 8
    one = D.stratified_minibatches(B, mb, torch.Generator().manual_seed(3), world=1, at=0)
    assert sorted(torch.cat(one).tolist()) == list(range(B))  # an epoch visits every row once
    shards = [
        D.stratified_minibatches(B, mb, torch.Generator().manual_seed(3), world=world, at=r)
        for r in range(world)
    ]
    for k, rows in enumerate(one):
        # rank r's local row i is global row r * B / world + i
        union = sorted(i + r * (B // world) for r in range(world) for i in shards[r][k].tolist())
        assert union == sorted(rows.tolist())
        assert all(len(s[k]) == mb // world for s in shards)


def test_config_refuses_batches_that_do_not_split():
    c = load_config(
        None, ["train.algo=grpo", "rollout.batch_size=8", "rollout.group_size=4", "optim.minibatch_size=4"]
    )
    check_world_size(c, 2)  # 2 groups of 4, minibatch 4: fine
    with pytest.raises(ConfigError, match="rollout.batch_size"):
        check_world_size(c, 4)  # 2 groups cannot go to 4 processes without splitting one
    c = load_config(None, ["rollout.batch_size=8", "optim.minibatch_size=2"])
    with pytest.raises(ConfigError, match="optim.minibatch_size"):
        check_world_size(c, 4)


# ---- (c) sampling: per-sample seeds, exact Gumbel-max -----------------------------------------
PROMPTS = [
    "the movie was",
    "a terrible boring film with",
    "good",
    "i loved this story, a delightful",
    "worst",
    "an excellent, charming and funny comedy",
    "the plot is weak but",
    "bad bad",
]


def _eos_likely_lm(tok, seed=0, eos_bias=3.0):
    lm = make_tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = eos_bias  # some responses end early, so rows differ in length
    lm.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    return lm


def _rows(ro: Rollout) -> list[list[int]]:
    return [ids[m].tolist() for ids, m in zip(ro.response_ids, ro.response_mask)]


@pytest.mark.numerics
def test_samples_of_a_batch_are_the_samples_of_its_shards(tiny_tokenizer):
    lm = _eos_likely_lm(tiny_tokenizer)
    seeds = sample_seeds(7, 3, range(len(PROMPTS)))
    whole = generate(lm, tiny_tokenizer, PROMPTS, 8, 0.9, seeds=seeds)
    halves = [
        generate(lm, tiny_tokenizer, PROMPTS[s], 8, 0.9, seeds=seeds[s]) for s in (slice(0, 4), slice(4, 8))
    ]
    assert _rows(whole) == _rows(halves[0]) + _rows(halves[1])
    assert whole.response_mask.sum(-1).unique().numel() > 1, "the test needs responses of different lengths"
    # the seed of a sample is a function of (seed, step, index): another step draws other samples
    other = generate(lm, tiny_tokenizer, PROMPTS, 8, 0.9, seeds=sample_seeds(7, 4, range(len(PROMPTS))))
    assert _rows(other) != _rows(whole)


@pytest.mark.numerics
def test_gumbel_sampler_is_the_argmax_of_tempered_logits_plus_its_noise(tiny_tokenizer):
    """Exactness, structurally: every sampled token is argmax(logits / T + g) for the row's noise g.

    By the Gumbel-max theorem that argmax is an exact draw from softmax(logits / T). The logits
    come from a separate full forward; T = 0.5, so a temperature applied twice (or not at all)
    would pick other tokens.
    """
    # EOS likely enough that some responses end early (48 of 64 tokens valid with these seeds)
    lm = _eos_likely_lm(tiny_tokenizer, seed=1, eos_bias=2.0)
    T, n = 0.5, 8
    seeds = sample_seeds(0, 0, range(len(PROMPTS)))
    ro = generate(lm, tiny_tokenizer, PROMPTS, n, T, seeds=seeds)
    keys = torch.tensor(seeds, dtype=torch.int64)
    from tether.models.head import position_ids_from_mask

    with torch.no_grad():
        logits = lm(
            input_ids=ro.input_ids,
            attention_mask=ro.attention_mask,
            position_ids=position_ids_from_mask(ro.attention_mask),
        ).logits
    R = ro.response_ids.shape[1]
    logits = logits[:, -R:].double()  # (B, R, V) predicting each response token
    checked, differs_at_t1 = 0, 0
    for t in range(R):
        noise = gumbel_noise(keys, t, logits.shape[-1])  # every row's noise at step t, as in generation
        want = (logits[:, t] / T + noise).argmax(-1)
        valid = ro.response_mask[:, t]
        assert torch.equal(ro.response_ids[valid, t], want[valid]), f"position {t}"
        checked += int(valid.sum())
        differs_at_t1 += int(((logits[:, t] + noise).argmax(-1) != want)[valid].sum())
    assert checked >= 20 and not ro.response_mask.all() and differs_at_t1 > 0, (
        "T = 1 would have picked the same tokens: the test could not fail"
    )


# ---- (b) end to end: accelerate launch with 2 processes against 1 process ----------------------
def _eos_model_dir(tok, out: Path) -> Path:
    """A tiny Llama that ends early often (mean response ~3 of 6 tokens), so processes hold
    different numbers of valid tokens: a constant direction ``u`` added to the last hidden state
    (an MLP bias) and an EOS embedding (tied to the LM head) along ``u`` give EOS a logit of ~3."""
    lm = make_tiny_llama(
        len(tok), seed=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, mlp_bias=True
    )
    with torch.no_grad():
        for layer in lm.model.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.bias.zero_()
        u = torch.nn.functional.normalize(
            torch.randn(lm.config.hidden_size, generator=torch.Generator().manual_seed(0)), dim=0
        )
        lm.model.layers[-1].mlp.down_proj.bias.copy_(u)
        lm.model.embed_tokens.weight[tok.eos_token_id] = 0.8 * u
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _args(model_dir, prompts, out, algo):
    overrides = {
        "rollout.batch_size": 8,
        "rollout.max_new_tokens": 6,
        "optim.minibatch_size": 4,
        "optim.epochs": 2,
        # the learning rate these comparisons were written for (the default rose to 8e-5): clip
        # fractions count tokens past a boundary, and a larger step brings more of them within
        # float32 rounding of it, where 1 and 2 processes may count one token differently
        "optim.lr": "4e-5",
        "train.algo": algo,
        "eval.every": 0,
        # the per-tensor AdamW loop: with the fused kernel, DPO's KL after one update was 4e-5
        # relative off between 1 and 2 processes, while 1-process loop, 2-process loop and
        # 2-process fused agreed to 1e-7 (rounding inside the kernel, not data parallelism);
        # fused against loop is tested in tests/e2e/test_optim.py
        "optim.fused_adamw": "false",
    }
    args = tiny_run_args(model_dir, prompts, out, overrides)
    return args + (["rollout.group_size=2"] if algo in ("grpo", "rloo") else [])


def _accelerate_launch(processes: int) -> list[str]:
    """``accelerate launch`` of ``processes`` CPU processes, up to the script or ``-m``: --multi_gpu
    selects accelerate's torchrun launcher, which on a CPU-only machine runs gloo. Its rendezvous
    takes a free port, not torchrun's fixed 29500, so that launches of two pytest-xdist workers
    (`make test`) never meet. The port is drawn below the kernel's ephemeral range, which the
    other worker's gloo sockets take theirs from, in the moment before torchrun binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()  # not the tests' seeded generators
    for _ in range(100):
        port = rng.randrange(10_000, max(low, 10_001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    return [
        accelerate,
        "launch",
        "--multi_gpu",
        f"--num_processes={processes}",
        "--num_machines=1",
        f"--main_process_port={port}",
        "--mixed_precision=no",
        "--dynamo_backend=no",
    ]


def _launch(args, processes: int) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if processes == 1:
        cmd = [sys.executable, "-m", "tether", "train", *args]
    else:
        cmd = [*_accelerate_launch(processes), "-m", "tether", "train", *args]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    said = p.stdout + p.stderr
    # Known defect, open: under forced AVX2 kernels a rank sometimes aborts at interpreter exit
    # ("terminate called without an active exception", -6) after the run finished and wrote
    # everything (2 of 4 CI runs on 2026-12-06). Accepted only with that signature after
    # "tether: done"; every result the tests compare is still read from the run's files.
    exit_abort = "terminate called without an active exception" in said and "tether: done in" in said
    if p.returncode != 0 and exit_abort:
        warnings.warn("a rank aborted at exit after the run finished (known, open defect)", stacklevel=2)
    else:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return said


def _in_process(args) -> None:
    """The one-process run of ``args`` in this process, at one thread as :func:`_launch`'s ranks
    run: the 1-vs-2 cases' baseline, without a process start (imports alone take 5-7 s here)."""
    from tether.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *args]) == 0
    finally:
        torch.set_num_threads(threads)


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL a launcher and every process under it, and wait until none runs; returns their pids.

    torchrun starts each worker in a session of its own (``start_new_session``), so a signal to
    the launcher's process group leaves the workers training on and writing the run folder. The
    launcher is stopped first so it starts no process after the list is taken."""
    import psutil

    root = psutil.Process(pid)
    root.send_signal(signal.SIGSTOP)
    procs = [root, *root.children(recursive=True)]
    for q in procs:
        q.send_signal(signal.SIGKILL)

    def running(q: psutil.Process) -> bool:
        try:  # an orphan the container's init does not reap stays a zombie: dead all the same
            return q.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + 60
    while any(running(q) for q in procs[1:]):
        assert time.time() < deadline, "a worker survived SIGKILL"
        time.sleep(0.05)
    return [q.pid for q in procs]


_ONE_PROCESS: dict[str, Path] = {}
"""algo -> the folder of its 1-process run in this session (the baseline of every 2-process case)."""


@pytest.mark.numerics
@pytest.mark.parametrize(
    "algo",
    [
        "ppo",
        "grpo",
        "dpo",
        "ppo, micro-batches",
        "ppo, fsdp",
        "grpo, fsdp, whole-model generation",
        "dpo, fsdp",
        # the anchor and bf16 rollouts together: two independent levers, one launch fewer
        "grpo, anchor, bf16 rollouts",
        # the anchor's weight under anchor.budget: every process reads the whole batch's forward
        # KL (an all-reduce each optimizer step, in step with FSDP's collectives)
        "grpo, anchor budget, fsdp",
    ],
)
def test_two_processes_log_the_first_step_of_one(algo, tiny_tokenizer, prompt_file, tmp_path):
    """1 vs 2 processes: the same samples and, to float32 rounding, the same metrics.

    Only the grouping differs (other padding widths and row groupings in the forwards, sums split
    over ranks), so each metric is compared within the rounding of a reordered sum of its terms,
    derived from the magnitudes the row logs (tests/numerics.py); counts and the step-0 KL exactly.
    """
    from tests.numerics import assert_rows_close

    model = _eos_model_dir(tiny_tokenizer, tmp_path / "model")
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["dpo.n_pairs=8", "dpo.candidates=2", "dpo.kl_eval_prompts=4"] if algo.startswith("dpo") else []
    # "micro-batches": the 2 processes run each of their 2 rows of a minibatch through forward and
    # backward alone (gradient accumulation, DDP's all-reduce only after the last), 1 process all 4
    micro = ["optim.micro_batch_size=1"] if "micro" in algo else []
    # "fsdp": the 2 processes each hold half of every weight, gradient and AdamW moment (FSDP2);
    # the 1 process is the plain unsharded run
    fsdp = ["train.sharding=fsdp"] if "fsdp" in algo else []
    fsdp += ["train.sharded_generation=whole"] if "whole" in algo else []
    # and rank 0 evaluates the reference alone before the first step (FSDP records those forwards:
    # a DPO run whose first backward followed them hung before tether.models.sharding forgot them)
    fsdp += ["eval.n_prompts=4"] if fsdp else []
    if "anchor" in algo:  # the text anchor: each process takes 2 of the 4 texts of every batch
        texts = tmp_path / "anchor.txt"
        texts.write_text(
            "".join(f"plain text {i} of some length, said {i % 3 + 1} times\n" for i in range(8))
        )
        extra += [f"anchor.texts={texts}", "anchor.coef=0.5", "anchor.batch_size=4"]
        # a budget far over the KL: the weight falls from 0.5 by 0.01 x (1 - forward KL) per
        # optimizer step, 4 of them (kp 0: no clamp at 0 reached, each weight a rounding of 0.5's size)
        extra += (
            ["anchor.budget=1", "anchor.budget_eta=0.01", "anchor.budget_kp=0"] if "budget" in algo else []
        )
    if "bf16" in algo:  # rollout.dtype=bf16: each process decodes on its own bfloat16 copy
        extra += ["rollout.dtype=bf16"]
    key, algo = algo, algo.split(",")[0]
    key = algo if "anchor" not in key and "bf16" not in key else key  # their 1-process runs are their own
    # the 1-process run of an algorithm is the same run in every case (the same model, prompts and
    # settings): run once per session, then read
    if key in _ONE_PROCESS:
        one = _ONE_PROCESS[key]
    else:
        _in_process(_args(model, prompt_file, one, algo) + extra)
        _ONE_PROCESS[key] = one
    log = _launch(_args(model, prompt_file, two, algo) + extra + micro + fsdp, 2)
    assert "2 processes (data parallel)" in log  # not one process left alone by the launcher
    if fsdp:
        assert "sharded (FSDP)" in log
    a, b = (json.loads((d / "metrics.jsonl").read_text().splitlines()[0]) for d in (one, two))
    if algo != "dpo":  # a 1-step run decodes eagerly under rollout.compile=auto
        assert a.pop("rollout/compiled") == b.pop("rollout/compiled") == 0.0
    if fsdp and algo != "dpo":  # rank 0's reference forwards also count its reference evaluation
        assert b.pop("kl/reference_forwards") > a.pop("kl/reference_forwards")
    # 8 rows x 6 response positions per reduction; the entropy also sums the vocabulary
    margins = assert_rows_close(a, b, 8 * 6, len(tiny_tokenizer), "1 vs 2 processes: ")
    if algo != "dpo":
        # step 0, before any update: policy == reference, so the KL is exactly 0 on both
        assert a["objective/kl"] == b["objective/kl"] == 0.0
        assert a["objective/kl_exact"] == b["objective/kl_exact"] == 0.0
        assert a["policy/ratio_max_dev_first"] == 0.0
        if not micro:  # the first minibatch is the old log-probs' own batch on every process
            assert b["policy/ratio_max_dev_first"] == 0.0
    if algo != "dpo":
        # the same samples, whichever process drew them (the sample table gathers all processes)
        sa, sb = (
            [json.loads(line)["response"] for line in (d / "samples.jsonl").read_text().splitlines()]
            for d in (one, two)
        )
        assert sa == sb
        assert 1.5 < a["response/length"] < 5.5, "the test needs responses of different lengths"
    if "anchor.budget=1" in extra:  # the weight moved (0.5 - 0.01 x about 1 x 1..4: mean ~0.475)
        assert 0.47 < a["anchor/coef"] < 0.48, a["anchor/coef"]
    worst = max(margins, key=margins.get)
    print(
        f"{algo}: largest difference 1 vs 2 processes {margins[worst]:.2g} of its tolerance "
        f"({worst}: {a[worst]!r} vs {b[worst]!r})"
    )


def test_two_processes_decode_compiled_what_they_decode_eagerly(tiny_tokenizer, prompt_file, tmp_path):
    """rollout.compile=true with 2 processes (each compiles its own decode step, and both check
    step 0's compiled decode against the eager one): every metric of 3 GRPO steps equals the eager
    2-process run's, bit for bit, but how the rollouts were decoded and the sampler's float32
    rounding against the learner's."""
    if why := can_compile("cpu"):
        pytest.skip(why)
    model = _eos_model_dir(tiny_tokenizer, tmp_path / "model")
    runs = {}
    for setting in ("false", "true"):
        out = tmp_path / setting
        try:
            log = _launch(
                _args(model, prompt_file, out, "grpo") + ["train.steps=3", f"rollout.compile={setting}"], 2
            )
        except AssertionError as e:  # the run's own check refused the compiled decode
            if "does not reproduce the eager one" in str(e):
                pytest.xfail("torch.compile decodes another distribution here, refused as designed")
            raise
        assert "2 processes (data parallel)" in log
        runs[setting] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/compiled"] for r in runs["true"]] == [0.0, 1.0, 1.0]
    kept = [  # the sampler's log-probs against the learner's: float32 rounding apart
        [
            {
                k: v
                for k, v in r.items()
                if not k.startswith(("time/", "rollout/logprob_", "rollout/compiled"))
            }
            for r in rows
        ]
        for rows in runs.values()
    ]
    assert kept[0] == kept[1]


def test_two_processes_train_in_bf16_with_float32_masters(tiny_tokenizer, prompt_file, tmp_path):
    """DDP over bf16 weights: micro-batch gradients summed by DDP's all-reduce, moved to the float32
    masters once per step. Step 0 is exact on both processes (KL 0.0, first ratio 1.0), and the
    update moves the policy (step 1's exact KL > 0)."""
    model = _eos_model_dir(tiny_tokenizer, tmp_path / "model")
    args = _args(model, prompt_file, tmp_path / "two", "ppo") + [
        "model.dtype=bfloat16",
        "train.steps=2",
        "optim.micro_batch_size=1",
        "optim.lr=1e-3",
    ]
    log = _launch(args, 2)
    assert "2 processes (data parallel)" in log and "cpu weights in bfloat16" in log
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["objective/kl"] == 0.0 and rows[0]["objective/kl_exact"] == 0.0
    assert rows[1]["objective/kl_exact"] > 0.0


def test_two_processes_hand_each_reward_call_its_own_rows_answers(tiny_tokenizer, tmp_path):
    """GRPO, G = 4, 2 processes: each process scores its contiguous shard, and the reward function
    (tests.conftest:answer_checker, which raises on a misaligned row) gets every row's own answer."""
    rows = [
        {"prompt": f"the movie number {i} was", "answer": f"ans:the movie number {i} was"} for i in range(40)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = _eos_model_dir(tiny_tokenizer, tmp_path / "model")
    args = [a for a in _args(model, data, tmp_path / "two", "grpo") if not a.startswith("rollout.group_size")]
    log = _launch(args + ["rollout.group_size=4", "reward.scorer=tests.conftest:answer_checker"], 2)
    assert "2 processes (data parallel)" in log
    assert (tmp_path / "two" / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.e2e
def test_fsdp_sigkill_then_resume_matches_uninterrupted(tiny_tokenizer, prompt_file, tmp_path):
    """2 processes, train.sharding=fsdp (with micro-batches), evaluating and checkpointing every 2
    steps: a run killed (SIGKILL, launcher and both workers) after its step-1 checkpoint and
    resumed with 2 processes logs every row of the uninterrupted run bit for bit, and the same
    eval.json. The same checkpoint (each process's shards) resumes on 1 unsharded process too."""
    from tests.conftest import metric_rows
    from tether.run.checkpoint import latest_checkpoint

    model = _eos_model_dir(tiny_tokenizer, tmp_path / "model")
    full, killed = tmp_path / "full", tmp_path / "killed"

    def args(out):
        a = _args(model, prompt_file, out, "ppo") + ["train.sharding=fsdp"]
        drop = ("train.steps=", "eval.n_prompts=", "eval.every=", "eval.judge=", "train.save_model=")
        drop += ("train.checkpoint_every=", "reward.scorer=")
        return [x for x in a if not x.startswith(drop)] + [
            "train.steps=4",
            "train.checkpoint_every=2",
            "eval.n_prompts=4",
            "eval.every=2",
            "eval.periodic_prompts=4",
            "eval.judge=tests.conftest:length_judge",
            "eval.fluency_model=none",
            "reward.scorer=tests.conftest:slow_length_scorer",
            "train.save_model=true",
            # 2 micro-batches per process and minibatch: FSDP's reduce-scatter held until the last
            "optim.micro_batch_size=1",
        ]

    _launch(args(full), 2)
    cmd = [*_accelerate_launch(2), "-m", "tether", "train", *args(killed)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once step 2 is logged (the checkpoint of step 1 exists)
        m = killed / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    killed_pids = _kill_tree(p.pid)
    p.wait(timeout=60)
    assert len(killed_pids) >= 3  # the launcher and its 2 workers
    assert latest_checkpoint(killed).name == "step-000001"
    other = tmp_path / "one-process"
    shutil.copytree(killed, other)
    # the checkpoint holds each process's shards (torch.distributed.checkpoint), no whole copy; one
    # unsharded process without a process group reads them whole: weights moved from the start,
    # and AdamW's moments for every trained tensor
    ckpt = latest_checkpoint(killed)
    assert (ckpt / "sharded").is_dir() and not (ckpt / "policy.safetensors").exists()
    from transformers import AutoModelForCausalLM

    from tether.models.policy import PolicyWithValue
    from tether.run.checkpoint import load_sharded_state

    policy = PolicyWithValue(AutoModelForCausalLM.from_pretrained(model))
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    load_sharded_state(ckpt / "sharded", policy, optimizer)
    assert any(not torch.equal(start[k], v) for k, v in policy.state_dict().items())
    assert len(optimizer.state) == len(params)
    assert all(float(optimizer.state[p]["exp_avg_sq"].sum()) > 0 for p in params)

    _launch(["--resume", str(killed)], 2)
    a, b = metric_rows(full), metric_rows(killed)
    assert [r["step"] for r in b] == list(range(4))
    assert a == b  # every metric of every step, bit for bit (CPU, fixed seed)
    assert json.loads((full / "eval.json").read_text()) == json.loads((killed / "eval.json").read_text())
    # the saved policy is the whole model: it loads alone, and as a model folder it scores
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(full / "policy")

    log = _launch(["--resume", str(other), "train.sharding=none"], 1)
    assert "resuming after step 1" in log
    assert [r["step"] for r in metric_rows(other)] == list(range(4))
    # and back: that unsharded run's last checkpoint (whole tensors) resumes sharded, 2 processes
    # each cutting its own shard of the weights and AdamW moments
    assert (latest_checkpoint(other) / "policy.safetensors").exists()
    log = _launch(["--resume", str(other), "train.sharding=fsdp", "train.steps=5"], 2)
    assert "resuming after step 3" in log and "sharded (FSDP)" in log
    assert [r["step"] for r in metric_rows(other)] == list(range(5))


def test_fsdp_refuses_what_it_does_not_do_and_accelerates_own_sharding():
    """train.sharding=fsdp: LoRA, a low-precision model.dtype and eval.best_by are refused up
    front, each naming its field; so is an accelerate launch that would shard by itself."""
    from tether.run.setup import check_launcher

    for override, field in (
        ("model.lora_r=8", "train.sharding"),
        ("model.dtype=bfloat16", "train.sharding"),
        ("eval.best_by=gold", "eval.best_by"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, ["train.sharding=fsdp", override, "eval.every=2"])
    load_config(None, ["train.sharding=fsdp", "model.dtype=float32"])  # what it does, accepted
    with pytest.raises(ValueError, match="train.sharding=fsdp"):
        check_launcher("FSDP")
    with pytest.raises(ValueError, match="MULTI_GPU"):
        check_launcher("DEEPSPEED")
    check_launcher("MULTI_GPU")


@pytest.mark.e2e
def test_two_processes_draw_their_own_random_numbers_for_an_environment(
    tiny_model_dir, prompt_file, tmp_path
):
    """Each process seeds Python's and NumPy's generators for itself (TRL's device-specific
    seed): with one seed for all, rank 1's environment replayed rank 0's draws, so rows of the
    two halves of the batch got the same random tool outputs. Rank 0 draws what a one-process
    run draws first."""
    model = tiny_model_dir
    tool = [
        "rollout.env=tests.conftest:random_tool_env",
        "rollout.max_turns=2",
        "rollout.stop_strings=[e, a, o, t, i, n]",  # in nearly every token: most turns stop
        "rollout.max_new_tokens=16",
        "train.sample_every=1",
        "train.steps=1",
    ]
    _launch(_args(model, prompt_file, tmp_path / "two", "ppo") + tool, 2)
    rows = [json.loads(line) for line in (tmp_path / "two" / "samples.jsonl").read_text().splitlines()]
    halves = [[r["env"] for r in rows[:4] if r["env"]], [r["env"] for r in rows[4:] if r["env"]]]
    assert halves[0] and halves[1], "the test needs rows of both processes that called the tool"
    assert halves[0][0] != halves[1][0], halves  # each rank's first draw: its own
    _in_process(_args(model, prompt_file, tmp_path / "one", "ppo") + tool)
    one = [json.loads(line) for line in (tmp_path / "one" / "samples.jsonl").read_text().splitlines()]
    assert [r["env"] for r in one if r["env"]][0] == halves[0][0]  # rank 0 is the one-process run


CALLBACK_SCRIPT = '''
import json, os, sys
from transformers import TrainerCallback
import tether
from tether.run.config import load_config


class StopAfterStep1(TrainerCallback):
    """A transformers callback as TRL's docs write one: it logs what it sees and asks to stop."""

    def on_step_end(self, args, state, control, **kwargs):
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(sys.argv[1], f"events-{rank}.jsonl"), "a") as f:
            seen = {"step": state.global_step, "model": type(kwargs.get("model")).__name__}
            f.write(json.dumps(seen) + "\\n")
        if state.global_step >= 1:
            control.should_training_stop = True
        return control


config = load_config(None, sys.argv[2:])
tether.train(config, callbacks=[StopAfterStep1()])
'''


def test_two_processes_run_a_trainer_callback_and_stop_together(tiny_tokenizer, prompt_file, tmp_path):
    """A transformers TrainerCallback under two processes: it runs on rank 0 (tether's hooks run
    there), its should_training_stop ends both ranks after the same step (no rank waits alone in a
    collective), checkpointed."""
    model = _eos_model_dir(tiny_tokenizer, tmp_path / "model")
    script = tmp_path / "cb.py"
    script.write_text(CALLBACK_SCRIPT)
    out = tmp_path / "run"
    args = [
        f"model.name={model}",
        f"data.prompts={prompt_file}",
        f"train.output_dir={out}",
        *[f"{k}={v}" for k, v in TINY_RUN.items() if k != "train.steps"],
        "train.algo=grpo",
        "rollout.group_size=2",
        "train.steps=5",
    ]
    cmd = [*_accelerate_launch(2), str(script), str(tmp_path), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    said = p.stdout + p.stderr
    exit_abort = "terminate called without an active exception" in said and "tether: done in" in said
    assert p.returncode == 0 or exit_abort, said[-3000:]
    events = [json.loads(x) for x in (tmp_path / "events-0.jsonl").read_text().splitlines()]
    # global_step counts finished steps, as in transformers: 1 after tether's step 0, which asks to stop
    assert [e["step"] for e in events] == [1] and events[0]["model"]  # the model reachable, as in TRL
    assert not (tmp_path / "events-1.jsonl").exists()  # rank 0 only
    assert [r["step"] for r in metric_rows(out)] == [0]
    assert (out / "checkpoints").is_dir() and "tether: done in" in said
