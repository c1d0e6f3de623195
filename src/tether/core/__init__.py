"""Torch-only math: KL estimators, log-probs, reward shaping, advantages, losses, controllers,
KL placement, the leash, health rules, best-of-N, reductions over processes.

Nothing here imports a model, a config object or anything of tether's outside ``core``
(``tests/test_layout.py``). Every function takes tensors and scalars.

Shape legend (written once; every docstring uses it):

====  ========================================================================
B     rows of a batch (one sampled response each)
P     prompt positions, left-padded
R     response positions (sampled tokens), right-padded after EOS
L     input positions of a forward, ``P + R - 1``
V     vocabulary size
G     rows per group sharing one prompt (GRPO, RLOO: ``rollout.group_size``)
====  ========================================================================

Masks follow the glossary: ``response_mask`` (B, R) is True where a token counts, everywhere: a
token the policy sampled, up to and including the first EOS. In a single-turn rollout that is a
prefix of each row; in a multi-turn one it has holes where an environment wrote (False there), and
every function here takes any pattern (docs/kl.md, "Masks with holes"). Sign convention, written
once: with ``kl`` the per-token KL estimate, the non-score reward is ``-kl_coef * kl``. Units:
log-probabilities and KL in nats; a sequence KL is the masked sum over R, a per-token KL the
masked mean.
"""
