"""The frozen lower blocks run once per step: their output replayed for inputs they have seen.

With ``model.trainable_layers`` (the demo trains the last 6 of 30 blocks) the embeddings and the
lower blocks never change, so their output on a batch is the same in every forward of a step:
step 4's no-grad scoring, each epoch's forward with grad, the update guard's measures. The first
forward of a step records the output of the last frozen block; every later forward of the same
inputs skips the frozen blocks and feeds the recording to the first trainable one. Only the
trainable blocks, the final norm and the heads run again (on the demo: 6 of 30 blocks).

Exact by construction, not by tolerance: a recording is replayed only for inputs equal to the ones
it was made from (``torch.equal`` on the ids, the mask and the positions, so also the same shape),
while every frozen weight is the tensor it was (its in-place version counter unchanged), under the
same autocast setting. The replayed tensor is then the one the blocks would compute again: the
same kernels on the same shapes and values (CPU kernels are deterministic; the frozen blocks take
no input that requires grad, so autograd's mode does not change their kernels either). Tested bit
for bit against runs without it (``tests/models/test_frozen.py``, ``tests/e2e/test_cli.py``).

Recordings live for one :meth:`FrozenBlocks.session` (a training step) and are dropped at its end.
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

KEPT_BYTES = 256 << 20
"""Most bytes of recordings kept across steps (:meth:`FrozenBlocks.around`'s ``keep``: the text
anchor's fixed batches) per process (256 MiB); past it such a forward runs every block."""

RECORDED_BYTES = 1 << 30
"""Most bytes of recorded block outputs held at once per process (1 GiB): past it a forward runs
every block and records nothing (the demo's batch of 16 rows of prompt and response takes a few MB)."""


def trunk_blocks(lm: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks of a causal LM's trunk (``.layers``, GPT-2's ``.h``), or None."""
    trunk = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    if trunk is None:
        return None
    blocks = getattr(trunk, "layers", None)
    if blocks is None:
        blocks = getattr(trunk, "h", None)
    return blocks if isinstance(blocks, nn.ModuleList) else None


FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_norm", "norm_f")
"""Names of a trunk's children that run after its blocks (Llama's ``norm``, GPT-2's ``ln_f``, Phi's
``final_layernorm`` ...): they may train while the blocks below replay."""


def before_blocks(lm: nn.Module) -> list[nn.Parameter]:
    """The trunk's weights outside its blocks and outside a final norm (:data:`FINAL_NORMS`): the
    embeddings and what else runs before the blocks (or beside them)."""
    trunk = getattr(lm, lm.base_model_prefix)
    blocks = trunk_blocks(lm)
    return [
        p
        for name, module in trunk.named_children()
        if module is not blocks and name not in FINAL_NORMS
        for p in module.parameters()
    ]


CROSS_BLOCK_STATE = ("num_kv_shared_layers",)
"""Config fields of models whose blocks pass more than hidden states to later blocks (Gemma 3n's
and Gemma 4's key/value sharing: later blocks read keys and values the earlier ones stored). A
replay skips the earlier blocks, so it would leave that state unfilled: no replay there."""


def shares_state_across_blocks(lm: nn.Module) -> bool:
    """Whether ``lm``'s config (or its text config) sets one of :data:`CROSS_BLOCK_STATE` above 0."""
    cfg = getattr(lm, "config", None)
    configs = [cfg, getattr(cfg, "text_config", None)]
    return any(
        int(getattr(c, name, 0) or 0) > 0 for c in configs if c is not None for name in CROSS_BLOCK_STATE
    )


def frozen_lower_blocks(lm: nn.Module) -> int:
    """How many of ``lm``'s first blocks take no trainable weight, with nothing trainable before them.

    Every weight of the trunk outside its blocks but a final norm (:func:`before_blocks`: the
    embeddings, a position table) must be frozen too; else, or with blocks tether cannot find, 0.
    A LoRA model has adapters in every block it targets: 0 there.
    """
    blocks = trunk_blocks(lm)
    if blocks is None or len(blocks) == 0 or any(p.requires_grad for p in before_blocks(lm)):
        return 0
    if shares_state_across_blocks(lm):
        return 0
    n = 0
    for block in blocks:
        if any(p.requires_grad for p in block.parameters()):
            break
        n += 1
    return n if n < len(blocks) else 0  # all frozen: nothing trains in the trunk, nothing to replay into


@dataclass
class Recording:
    """The last frozen block's output for one forward's inputs."""

    input_ids: Tensor
    """(B, L) long."""
    attention_mask: Tensor
    """(B, L)."""
    position_ids: Tensor
    """(B, L) long."""
    autocast: bool
    output: object
    """What the block returned (a (B, L, d) tensor, or a tuple holding it in transformers 4.x), detached."""
    nbytes: int


class FrozenBlocks:
    """Records and replays the output of ``lm``'s first ``n`` blocks (:func:`frozen_lower_blocks`).

    Outside a :meth:`session` it does nothing. Inside one, :meth:`around` wraps a trunk forward:
    a replay where a recording matches the inputs (the first ``n`` blocks return it without
    running), else a full forward that records. A forward of fixed inputs that come back across
    steps (the text anchor's batches) passes a ``keep`` key: its recording is kept past the
    session, in or out of one, for as long as the frozen weights are unchanged.

    Attributes:
        replayed: forwards that skipped the frozen blocks since construction (a counter the tests read).
    """

    def __init__(self, lm: nn.Module, n: int):
        blocks = trunk_blocks(lm)
        if blocks is None or not 1 <= n < len(blocks):
            raise ValueError(f"FrozenBlocks: n={n} must be in [1, number of blocks)")
        self.blocks = list(blocks)[:n]
        self.weights = before_blocks(lm) + [p for b in self.blocks for p in b.parameters()]
        """Every weight the replayed part depends on (:func:`before_blocks`, the frozen blocks')."""
        self.recordings: list[Recording] = []
        self.versions: tuple[int, ...] | None = None
        self.active = False
        self.replayed = 0
        self.kept: dict[Hashable, Recording] = {}
        """Recordings kept across sessions, by the caller's key (:meth:`around`'s ``keep``)."""
        self.kept_versions: tuple[int, ...] | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        """Record and replay inside the block (a training step's forwards); the recordings go at its end."""
        self.active, self.recordings = True, []
        self.versions = self._versions()
        try:
            yield
        finally:
            self.active, self.recordings, self.versions = False, [], None

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.weights)

    def _match(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Recording | None:
        for r in self.recordings:
            if _same_inputs(r, input_ids, attention_mask, position_ids):
                return r
        return None

    @contextmanager
    def around(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: Hashable | None = None
    ) -> Iterator[None]:
        """Wrap one full-sequence trunk forward of these inputs (each (B, L)): replay or record.

        A frozen weight changed in place since the session began (a checkpoint loaded into the
        model, say) drops every recording and records afresh. With ``keep`` (a key the caller
        gives the same fixed inputs under every time), the recording is kept past the session and
        used in or out of one, checked against the inputs each time (:data:`KEPT_BYTES` in all).
        """
        if keep is not None:
            yield from self._around_kept(keep, input_ids, attention_mask, position_ids)
            return
        if not self.active:
            yield
            return
        if self._versions() != self.versions:
            self.recordings, self.versions = [], self._versions()
        found = self._match(input_ids, attention_mask, position_ids)
        if found is not None:
            yield from self._replaying(found)
            return
        made = yield from self._recording(input_ids, attention_mask, position_ids)
        if made is not None and sum(r.nbytes for r in self.recordings) + made.nbytes <= RECORDED_BYTES:
            self.recordings.append(made)

    def _around_kept(
        self, keep: Hashable, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor
    ) -> Iterator[None]:
        versions = self._versions()
        if versions != self.kept_versions:  # a frozen weight changed: nothing kept holds
            self.kept, self.kept_versions = {}, versions
        found = self.kept.get(keep)
        if found is not None and _same_inputs(found, input_ids, attention_mask, position_ids):
            yield from self._replaying(found)
            return
        made = yield from self._recording(input_ids, attention_mask, position_ids)
        self.kept.pop(keep, None)
        if made is not None and sum(r.nbytes for r in self.kept.values()) + made.nbytes <= KEPT_BYTES:
            self.kept[keep] = made

    def _replaying(self, found: Recording) -> Iterator[None]:
        def replay(*args, **kwargs):  # the block's output as recorded, its input unused
            return found.output

        for block in self.blocks:
            block.forward = replay  # an instance attribute: nn.Module.__call__ calls it
        self.replayed += 1
        try:
            yield
        finally:
            for block in self.blocks:
                del block.forward

    def _recording(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor
    ) -> Generator[None, None, Recording | None]:
        """Run the forward (the caller's, at the ``yield``) with the last frozen block's output
        caught; return its :class:`Recording`, or None where the blocks ran other than once."""
        seen: list[object] = []

        def record(module, args, output):
            seen.append(output)

        handle = self.blocks[-1].register_forward_hook(record)
        try:
            yield
        finally:
            handle.remove()
        if len(seen) != 1:  # the trunk ran its blocks other than once (a cache pass): keep nothing
            return None
        output = _detached(seen[0])
        return Recording(
            input_ids=input_ids.clone(),
            attention_mask=attention_mask.clone(),
            position_ids=position_ids.clone(),
            autocast=torch.is_autocast_enabled(input_ids.device.type),
            output=output,
            nbytes=_nbytes(output),
        )


def _same_inputs(r: Recording, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> bool:
    """Whether ``r`` was recorded from these very inputs, under the same autocast setting."""
    return (
        r.autocast == torch.is_autocast_enabled(input_ids.device.type)
        and r.input_ids.shape == input_ids.shape
        and torch.equal(r.input_ids, input_ids)
        and torch.equal(r.attention_mask, attention_mask)
        and torch.equal(r.position_ids, position_ids)
    )


def _detached(output: object) -> object:
    if isinstance(output, Tensor):
        return output.detach()
    if isinstance(output, tuple):
        return tuple(_detached(o) for o in output)
    return output


def _nbytes(output: object) -> int:
    if isinstance(output, Tensor):
        return output.numel() * output.element_size()
    if isinstance(output, tuple):
        return sum(_nbytes(o) for o in output)
    return 0
