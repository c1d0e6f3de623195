"""The capability text: human-written sentences no tether run trains on, whose per-token NLL
under the policy against the reference's measures what the seeds call the alignment tax ("it
retains general capabilities"): whether the policy still models ordinary text as well as the
reference did.

The sentences are the NYT editorial snippets of the ICWSM-2014 data (Hutto & Gilbert 2014, MIT;
5,190 sentences, the archive the demo's prompts and the gold judge already cache): the demo
trains on movie-review prefixes, never on these. :func:`capability_texts` takes those of at
least 8 words in the order of their SHA-256, so the same N sentences in every run.

The text anchor's built-in corpus (``anchor.texts=builtin``, :func:`anchor_texts`) is the rest of
the same file: the sentences from rank :data:`PROBE_MAX` on, which no probe takes (the probe's
size is capped there), checked disjoint from them.
"""

from __future__ import annotations

import hashlib

from tether.data.prompts import icwsm_file, read_ground_truth

CAPABILITY_FILE = "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt"
"""The ICWSM-2014 file the capability sentences come from."""

MIN_WORDS = 8
"""The shortest sentence used, words: a shorter one has too few tokens to measure."""

PROBE_MAX = 2000
"""The most sentences the probe takes (``eval.capability_texts``); the anchor's begin after them."""


def _ranked() -> list[str]:
    """Every distinct sentence of at least :data:`MIN_WORDS` words, in SHA-256 order (4,544)."""
    return sorted(
        {r.text for r in read_ground_truth(icwsm_file(CAPABILITY_FILE)) if len(r.text.split()) >= MIN_WORDS},
        key=lambda t: hashlib.sha256(t.encode()).hexdigest(),
    )


def capability_texts(n: int) -> list[str]:
    """The first ``n`` NYT editorial sentences of at least :data:`MIN_WORDS` words, ordered by
    the SHA-256 of their text (fixed across runs and seeds).

    Raises:
        ValueError: fewer than ``n`` such sentences (there are 4,000 and more).
        RuntimeError: the ICWSM archive could not be downloaded (from :func:`icwsm_file`).
    """
    if n > PROBE_MAX:
        raise ValueError(f"eval.capability_texts={n}: at most {PROBE_MAX} (the rest is the text anchor's)")
    return _ranked()[:n]


def normalized(text: str) -> str:
    """``text`` lower-cased with its runs of white space made one space: the form the anchor's
    disjointness from the probe is checked in."""
    return " ".join(text.lower().split())


def anchor_texts() -> list[str]:
    """The text anchor's built-in corpus: the capability file's sentences from rank
    :data:`PROBE_MAX` on, in SHA-256 order, less any that holds a probe sentence or is held in one
    once both are :func:`normalized` (5 of 2,544: the file repeats a few snippets inside longer
    ones), so no probe sentence is trained on, whatever ``eval.capability_texts``. About 1 s.

    Raises:
        RuntimeError: the ICWSM archive could not be downloaded (from :func:`icwsm_file`).
    """
    ranked = _ranked()
    probe = [normalized(t) for t in ranked[:PROBE_MAX]]

    def overlaps(text: str) -> bool:
        n = normalized(text)
        return any(p in n or n in p for p in probe)

    return [t for t in ranked[PROBE_MAX:] if not overlaps(t)]
