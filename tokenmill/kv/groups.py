"""Which layers share a block table: the KV-cache groups of a model.

Layers are grouped by the context they read (`ModelConfig.layer_windows`): full-attention
layers need every position, a sliding-window layer only its last `window`. Groups are of equal
size, so a block id names the same number of bytes in every group and one pool serves them all:
the KV tensors are allocated per slot within a group (`num_slots` of them), and layer L keeps
its K and V in `slot_of[L]`'s tensor at the block ids of `group_of[L]`'s table. Gemma 3 270M
(15 sliding layers, 3 full) gets one full group and five sliding groups of three layers each; a
Mistral-style model (the window on every layer) one sliding group.

Without a windowed layer, or with window trimming off, there is one group holding every layer
and no window: each layer its own tensor, one table per request, as before groups existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]
    window: int | None  # None: the group's layers read every position; else the last `window`


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]  # full-attention groups first (a proposer's own KV uses group 0)
    num_layers: int

    @property
    def num_slots(self) -> int:
        """Layers per group: the KV tensors each block id indexes."""
        return len(self.groups[0].layers)

    @property
    def group_of(self) -> tuple[int, ...]:
        owner = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = g
        return tuple(owner)

    @property
    def slot_of(self) -> tuple[int, ...]:
        slot = [0] * self.num_layers
        for group in self.groups:
            for s, layer in enumerate(group.layers):
                slot[layer] = s
        return tuple(slot)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def trims(self) -> bool:
        """Whether some group drops blocks outside its window."""
        return any(window is not None for window in self.windows)


def single_group(num_layers: int) -> KVGroups:
    return KVGroups((KVGroup(tuple(range(num_layers)), None),), num_layers)


def kv_groups(config: ModelConfig, window_trimming: bool = True) -> KVGroups:
    """The model's groups: one per `num_slots` layers of equal window, the group size being the
    greatest common divisor of the layer counts per window, full-attention groups first; one
    untrimmed group when `window_trimming` is off or no layer has a window."""
    windows = config.layer_windows
    if not window_trimming or all(w is None for w in windows):
        return single_group(config.num_hidden_layers)
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    order = sorted(by_window, key=lambda w: (w is not None, -(w or 0)))
    groups = tuple(
        KVGroup(tuple(by_window[w][i : i + size]), w)
        for w in order
        for i in range(0, len(by_window[w]), size)
    )
    return KVGroups(groups, config.num_hidden_layers)
