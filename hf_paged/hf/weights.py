"""Which weights a cached prefix was computed with.

A block's K/V are a function of its tokens *and* the model's weights. The prefix cache hashes
tokens only, so every sequence is salted with a weights epoch, and the epoch moves on whenever the
weights fingerprint changes (the prefix cache is then dropped). Torch appears only to read
parameters; nothing here touches K/V.
"""

from __future__ import annotations

import torch


def weights_fingerprint(model: torch.nn.Module) -> int:
    """Changes whenever a parameter is replaced or modified in place (optimizer steps,
    `load_state_dict`): tensors count in-place writes in `_version`."""
    return hash(tuple((id(p), p._version) for p in model.parameters()))


class WeightsEpoch:
    """The current weights epoch of one cache, advanced by `note` when the fingerprint changes.

    Args:
        on_change: called when the weights changed since the last `note` (drops the prefix cache).
    """

    def __init__(self, on_change):
        self.epoch = 0
        self._fingerprint = None
        self._on_change = on_change

    def note(self, fingerprint) -> None:
        """Called before each step with the model's fingerprint. If it changed since the last step,
        cached prefixes were computed with other weights: forget them, and start a new epoch so that
        nothing computed before can ever be hit again."""
        if self._fingerprint is not None and fingerprint != self._fingerprint:
            self._on_change()
            self.epoch += 1
        self._fingerprint = fingerprint
