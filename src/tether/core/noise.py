"""Counter-based Gumbel noise: every row's noise for a decoded position in one vectorized computation.

The sampler (:class:`tether.models.sampling.GumbelMaxSampler`) needs, for row ``b`` at decoding
position ``t``, i.i.d. Gumbel(0, 1) noise over the vocabulary that depends on nothing but the
row's key (a hash of run seed, step and the sample's global index,
:func:`tether.models.sampling.sample_seeds`), ``t`` and the token id ``v``: then a sample does not
depend on its batch, its process or the number of processes. A generator per row gives that, at
the cost of one draw call per row per token. Here the noise is a pure function instead,

    ``bits(b, t, v) = mix(mix(key_b XOR (t + 1) * GOLDEN) XOR mix(v * GOLDEN'))``,

computed for the whole (B, V) block with a few integer tensor operations, where ``mix`` is the
SplitMix64 finalizer (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number
generators", OOPSLA; the variant-13 constants of Stafford 2011), a bijection of 64-bit words whose
output passes BigCrush. The top 52 bits give ``u = (k + 1/2) 2^-52`` in (0, 1), and
``g = -log(-log(u))``, in float64 (52, not 53: ``1 - 2^-54`` is not a float64 and would round to
1, a log of 0 and an infinite draw; ``1 - 2^-53`` is one).

Precision: ``u`` is never 0 or 1 (the half offset; both ends are exact float64 numbers), so ``g``
is always finite, in [-log(-log(2^-53)), -log(-log(1 - 2^-53))] = [-3.60, 36.7]. A true Gumbel
draw falls outside that range with probability about 2^-53 per draw (V * 2^-53 = 5.5e-12 per
token for V = 49,152), and the 2^-52 grid moves a draw by far less than the float64 rounding of
``z + g``: the resolution of the float64 ``torch.rand`` this replaces. Float32 noise would cut
the range at u = 1 - 2^-25, a tail of V * 2^-25 = 1.5e-3 per token: float64 it stays.

Integers: torch's int64 multiply and xor wrap modulo 2^64 as two's complement on every device
tether knows; :func:`check_wrapping` confirms it once per device against Python's exact integers
and refuses a device where it does not hold, rather than sample from other noise.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""2^64 / golden ratio, SplitMix64's increment: spreads the position over the word."""
GOLDEN_VOCAB = 0xD1B54A32D192ED03
"""A second odd constant (Steele and Vigna 2021's LXM multiplier), for the token id."""
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""SplitMix64's finalizer multipliers (Stafford's variant 13)."""
UNIT = 2.0**-52
"""The spacing of ``u``: 52 bits (module docstring)."""


def _signed(value: int) -> int:
    """A 64-bit word as the int64 that holds its bits."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits by ``k`` (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: Tensor) -> Tensor:
    """SplitMix64's finalizer on int64 words (any shape): a bijection, ~9 elementwise operations."""
    x = (x ^ _shr(x, 30)) * _signed(MIX1)
    x = (x ^ _shr(x, 27)) * _signed(MIX2)
    return x ^ _shr(x, 31)


def mix_int(x: int) -> int:
    """:func:`mix` on one Python integer, exactly (the reference the tensor version is checked against)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


@functools.cache
def check_wrapping(device: str) -> None:
    """Confirm that int64 tensors on ``device`` multiply and xor modulo 2^64 (cached per device).

    Raises:
        RuntimeError: they do not; the noise would not be the function documented above.
    """
    words = [0, 1, 2**62 + 12345, 2**63 - 1, -(2**63), -1, _signed(GOLDEN), _signed(MIX2)]
    x = torch.tensor(words, dtype=torch.int64, device=device)
    got = [int(v) & MASK64 for v in mix(x).tolist()]
    want = [mix_int(w) for w in words]
    if got != want:
        raise RuntimeError(
            f"int64 arithmetic on {device} does not wrap modulo 2^64 as two's complement, so tether's "
            "counter-based sampling noise cannot be computed exactly there; sample on another device "
            "(train.device=cpu)"
        )


@functools.lru_cache(maxsize=8)
def _vocab_words(vocab_size: int, device: str) -> Tensor:
    """(V,) int64 ``mix(v * GOLDEN_VOCAB)``: the token-id half of the hash, computed once."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix(v * _signed(GOLDEN_VOCAB))


def uniform_from_bits(bits: Tensor) -> Tensor:
    """int64 words -> float64 ``(k + 1/2) 2^-52`` in (0, 1), ``k`` the top 52 bits: never 0 or 1,
    both ends ``2^-53`` and ``1 - 2^-53`` exact float64 numbers."""
    return (_shr(bits, 12).to(torch.float64) + 0.5) * UNIT


def gumbel_noise(keys: Tensor, position: int, vocab_size: int) -> Tensor:
    """(B, V) float64 Gumbel(0, 1) noise of rows with ``keys`` at decoding ``position``.

    Args:
        keys: (B,) int64 row keys (:func:`tether.models.sampling.sample_seeds`), on the device
            the noise is wanted on.
        position: the decoding step, 0 for the first response token.
        vocab_size: V.

    Returns:
        (B, V) float64, row ``b`` a function of ``(keys[b], position, v)`` only; finite, in
        [-3.60, 36.7] (module docstring).

    Raises:
        RuntimeError: the device's int64 arithmetic does not wrap (:func:`check_wrapping`).
    """
    device = str(keys.device)
    check_wrapping(device)
    row = mix(keys ^ _signed((position + 1) * GOLDEN))  # (B,)
    bits = mix(row[:, None] ^ _vocab_words(vocab_size, device)[None, :])  # (B, V)
    return -torch.log(-torch.log(uniform_from_bits(bits)))
