"""VADER compound sentiment (Hutto & Gilbert 2014, ``vaderSentiment`` package, MIT) as a scorer."""

from __future__ import annotations

from tether.judges.contract import Scorer


def vader_scorer() -> Scorer:
    """VADER compound score, [-1, 1], of each text."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def score(texts: list[str]) -> list[float]:
        return [analyzer.polarity_scores(t)["compound"] for t in texts]

    return score
