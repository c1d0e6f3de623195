"""``eval.best_by``: keep the best policy the periodic evaluations saw, and end the run with it.

The seeds: "stop near the peak of held-out quality". :class:`BestPolicy` reads each periodic
evaluation's row (:meth:`BestPolicy.consider`), saves the policy to ``<run>/best`` when its score
beats every earlier one, says when ``eval.patience`` evaluations in a row brought no new best, and
at the end loads ``<run>/best`` back (:meth:`BestPolicy.restore`). A row counts only if it meets
the conditions (:func:`qualifies`): a gold score bought with broken text is no peak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from tether.run.checkpoint import best_folder, load_policy_weights, save_best
from tether.run.files import read_json

BEST_KEYS = {"gold": "eval/gold_score", "proxy": "eval/proxy_score"}
"""``eval.best_by`` -> the periodic evaluation's metric it maximizes."""


def qualifies(row: dict, fluency_margin: float | None, distinct_share: float | None) -> bool:
    """Whether a periodic evaluation's row meets eval.best_by's conditions: its fluency NLL at most
    ``fluency_margin`` nats per token above the reference's, its distinct-2 at least
    ``distinct_share`` of the reference's (a condition whose numbers the row lacks fails)."""
    if fluency_margin is not None:
        nll, ref = row.get("eval/fluency_nll"), row.get("eval/ref_fluency_nll")
        if not (
            isinstance(nll, (int, float)) and isinstance(ref, (int, float)) and nll - ref <= fluency_margin
        ):
            return False
    if distinct_share is not None:
        d, ref = row.get("eval/distinct_2"), row.get("eval/ref_distinct_2")
        if not (isinstance(d, (int, float)) and isinstance(ref, (int, float)) and d >= distinct_share * ref):
            return False
    return True


class BestPolicy:
    """The best-policy tracker of one run (``eval.best_by`` gold or proxy).

    Args:
        run_dir: the run folder; ``<run_dir>/best`` holds the best policy and its ``meta.json``.
        policy: the policy whose weights are saved and restored.
        best_by: "gold" or "proxy" (:data:`BEST_KEYS`).
        fluency_margin, distinct_share: :func:`qualifies`'s conditions (None: not required).
        patience: stop after this many evaluations in a row without a new best (0: never).
        history: the rows logged before (a resumed run's), in order.
    """

    def __init__(
        self,
        *,
        run_dir: Path,
        policy,
        best_by: str,
        fluency_margin: float | None = None,
        distinct_share: float | None = None,
        patience: int = 0,
        history: Iterable[dict] = (),
    ):
        self.run_dir, self.policy, self.best_by = Path(run_dir), policy, best_by
        self.key = BEST_KEYS[best_by]
        self.conditions = (fluency_margin, distinct_share)
        self.patience = patience
        self.evals: list[tuple[int, float, float | None]] = []  # (step, score or -inf, eval/kl)
        for row in history:
            self._add(row)

    def _add(self, row: dict) -> bool:
        value = row.get(self.key)
        if not isinstance(value, (int, float)):
            return False
        score = value if qualifies(row, *self.conditions) else -math.inf
        self.evals.append((row["step"], score, row.get("eval/kl")))
        return True

    def saved(self) -> dict | None:
        """``<run>/best/meta.json`` when it holds a policy chosen by this metric, else None (it
        may come from steps a resumed run discarded: ``<run>/best`` always holds the best policy
        the run has produced)."""
        folder = best_folder(self.run_dir)
        if folder is None:
            return None
        meta = read_json(folder / "meta.json")
        return meta if meta.get("metric") == self.key else None

    def consider(self, step: int, row: dict) -> str | None:
        """After step ``step``'s row is logged: if it holds a periodic evaluation, save the policy
        to ``<run>/best`` when its score beats every earlier one (those seen and the one
        ``<run>/best`` holds). Returns why to stop when ``patience`` evaluations in a row brought
        no new best, else None."""
        if not self._add(row) or self.evals[-1][0] != step:
            return None
        saved = self.saved()
        prior = [(s, v) for s, v, _ in self.evals[:-1]] + ([(saved["step"], saved["score"])] if saved else [])
        best_step, best_score = max(prior, key=lambda sv: sv[1]) if prior else (None, -math.inf)
        if best_score == -math.inf:
            best_step = None  # nothing has qualified yet
        _, score, kl = self.evals[-1]
        if score > best_score:
            save_best(self.run_dir, self.policy, {"step": step, "metric": self.key, "score": score, "kl": kl})
            return None
        since = sum(s > best_step for s, _, _ in self.evals) if best_step is not None else len(self.evals)
        if self.patience and since >= self.patience:
            return (
                f"{self.key} has not improved on step {best_step}'s {best_score:.3f} in {since} "
                f"evaluations (eval.patience={self.patience})"
                if best_step is not None
                else f"no evaluation met eval.best_by's conditions in {since} evaluations "
                f"(eval.patience={self.patience})"
            )
        return None

    def restore(self, last_step: int) -> dict | None:
        """Load ``<run>/best`` into the policy unless it is the policy of ``last_step`` (the last
        step trained); returns its meta.json, or None when there is no best policy."""
        meta = self.saved()
        if meta is not None and meta["step"] != last_step:
            load_policy_weights(self.run_dir / "best", self.policy)
        return meta
