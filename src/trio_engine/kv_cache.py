"""A KV cache whose layers grow in place, for the sampler.

transformers' ``DynamicCache`` appends each decode step's keys and values with
``torch.cat``, which copies the whole cache every step: 8 rows of the bundled model at
1024 tokens are 380 MB of fp32 KV, copied once per step. ``GrowingCache`` keeps each
layer's keys and values in buffers with room for more positions and writes new ones in
place; a layer's ``keys`` and ``values`` are views of the filled part, so code written
for ``DynamicCache`` reads them unchanged. fp32 decode steps of 8 rows ran 1.08x / 1.28-1.30x
/ 1.43-1.45x as fast at 256 / 1024 / 2048 cached tokens (``benchmarks/long_decode.py``).

Each view ``update`` returns knows its layer (``buffer_of``): a bf16 decode step on the
CPU multiplies by the whole buffers, their room zeroed and hidden
(``attention._over_buffers``), because batched matmuls ran 4-8x slower on the views than
on contiguous keys (one row's keys do not follow the last's) and a copy per step is what
this cache exists to avoid.

A buffer's length is a function of the filled length alone (``capacity``: the first of
16, 24, 32, 48, 64, 96, ... at or above it), whatever the cache's history: the CPU's
kernels sum a product or a softmax in an order that depends on the length they read, so
a bf16 row's numbers then depend on its length only, as with ``DynamicCache``, and not on
when its batch was merged or grew. A full buffer is replaced by the next length of the
grid, so over a long generation each position is copied about three times in all, and a
buffer is at most a third unused. Code that assigns a
layer's ``keys``/``values`` itself (the sampler trimming or merging batches, ``crop``)
lets the buffers go: the next ``update`` copies the assigned tensors into new ones.
Selecting batch rows (rows leaving, samples sharing a prefill) selects the buffers' rows,
room included.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 16  # the shortest buffer, in positions
_LAYER = "trio_kv_layer"  # the attribute by which update's views name their layer (``buffer_of``)


def _dropping_buffers(name: str) -> property:
    """A property kept in attribute ``name`` whose assignment lets the layer's buffers go."""
    def get(layer: GrowingLayer) -> torch.Tensor | None:
        return getattr(layer, name)

    def set_(layer: GrowingLayer, tensor: torch.Tensor | None) -> None:
        setattr(layer, name, tensor)
        layer._buffers = None

    return property(get, set_)


class GrowingLayer(DynamicLayer):
    """A full-attention layer's keys and values (B, heads, L, D), kept in buffers of
    (B, heads, capacity, D).

    ``keys`` and ``values`` are properties: assigning them (the sampler trimming or
    merging a batch, ``crop``, ``reset``) lets the buffers go at once, so their memory is
    freed with the old views rather than held until the layer's next ``update``; ``_show``
    takes buffers back after pointing the two at them."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None  # set by the properties (DynamicLayer's __init__)
    _room_zeroed = False  # whether ``buffer_of`` zeroed the current buffers' room (a flag, not a
    # reference: the buffers must go when the layer lets them go)

    keys = _dropping_buffers("_keys")  # type: ignore[assignment]
    values = _dropping_buffers("_values")  # type: ignore[assignment]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None  # set by lazy_initialization
        start = self.get_seq_length()
        stop = start + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or stop > buffers[0].shape[-2]:
            buffers = (_with_room(self.keys, key_states, stop), _with_room(self.values, value_states, stop))
        buffers[0][:, :, start:stop] = key_states
        buffers[1][:, :, start:stop] = value_states
        return self._show(buffers, stop)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._buffers is None:
            super().batch_select_indices(indices)
            return
        length = self.get_seq_length()
        self._show((self._buffers[0][indices], self._buffers[1][indices]), length)

    def _show(self, buffers: tuple[torch.Tensor, torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Point ``keys``/``values`` at the first ``length`` positions of ``buffers``, and
        keep those as the layer's."""
        fresh = buffers is not self._buffers
        views = (buffers[0][:, :, :length], buffers[1][:, :, :length])
        for view in views:
            setattr(view, _LAYER, weakref.ref(self))  # weak: the layer holds the views
        self.keys, self.values = views
        self._buffers = buffers
        if fresh:
            self._room_zeroed = False
        return views


def buffer_of(view: torch.Tensor) -> torch.Tensor | None:
    """The whole buffer (B, heads, capacity, D) whose first positions are ``view``, its
    room (every position past ``view``) zeros, while ``view`` is a ``GrowingLayer``'s
    current keys or values. None for any other tensor, an earlier step's view included
    (later steps wrote past it), or one made from such a view. The room is zeroed here,
    once per buffer, rather than when the buffer is made: only a bf16 decode step on the
    CPU reads it, and zeros would commit the room's memory in every other case."""
    owner = getattr(view, _LAYER, None)
    layer = owner() if owner is not None else None
    if layer is None or layer._buffers is None:
        return None
    for current, buffer in zip((layer.keys, layer.values), layer._buffers, strict=True):
        if current is view:
            if not layer._room_zeroed:  # later updates fill the room from its start, in order
                for whole in layer._buffers:
                    whole[:, :, view.shape[-2]:].zero_()
                layer._room_zeroed = True
            return buffer
    return None


def capacity(length: int) -> int:
    """The positions of a buffer holding ``length``: the first of 16, 24, 32, 48, 64, 96,
    ... (powers of two and one and a half times them) at or above it."""
    size = MIN_ROOM
    while size < length:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _with_room(filled: torch.Tensor, new: torch.Tensor, needed: int) -> torch.Tensor:
    """A buffer of ``capacity(needed)`` positions holding ``filled`` (the layer's keys or
    values so far, possibly empty) at its start; ``new`` gives the other dims."""
    batch, heads, _, dim = new.shape
    buffer = new.new_empty(batch, heads, capacity(needed), dim)
    if filled.numel():
        buffer[:, :, :filled.shape[-2]] = filled
    return buffer


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of ``GrowingLayer``s (full attention: a sliding-window model
    keeps every position, its mask hides the old ones, as with a config-less
    ``DynamicCache``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = GrowingLayer
