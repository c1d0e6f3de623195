"""The capability text: human-written sentences no tether run trains on, whose per-token NLL
under the policy against the reference's measures what the seeds call the alignment tax ("it
retains general capabilities"): whether the policy still models ordinary text as well as the
reference did.

The sentences are the NYT editorial snippets of the ICWSM-2014 data (Hutto & Gilbert 2014, MIT;
5,190 sentences, the archive the demo's prompts and the gold judge already cache): the demo
trains on movie-review prefixes, never on these. :func:`capability_texts` takes those of at
least 8 words in the order of their SHA-256, so the same N sentences in every run.
"""

from __future__ import annotations

import hashlib

from tether.data.prompts import icwsm_file, read_ground_truth

CAPABILITY_FILE = "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt"
"""The ICWSM-2014 file the capability sentences come from."""

MIN_WORDS = 8
"""The shortest sentence used, words: a shorter one has too few tokens to measure."""


def capability_texts(n: int) -> list[str]:
    """The first ``n`` NYT editorial sentences of at least :data:`MIN_WORDS` words, ordered by
    the SHA-256 of their text (fixed across runs and seeds).

    Raises:
        ValueError: fewer than ``n`` such sentences (there are 4,000 and more).
        RuntimeError: the ICWSM archive could not be downloaded (from :func:`icwsm_file`).
    """
    texts = sorted(
        {r.text for r in read_ground_truth(icwsm_file(CAPABILITY_FILE)) if len(r.text.split()) >= MIN_WORDS},
        key=lambda t: hashlib.sha256(t.encode()).hexdigest(),
    )
    if len(texts) < n:
        raise ValueError(f"eval.capability_texts={n}: only {len(texts)} capability sentences exist")
    return texts[:n]
