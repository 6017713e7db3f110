"""GrowingCache against transformers' DynamicCache: the same keys and values after any
mix of updates, row selections and assignments, without copying the cache per step."""

import torch
from transformers import DynamicCache

from trio_engine.kv_cache import MIN_ROOM, GrowingCache, buffer_of, capacity

from .helpers import poison_kv_room


def _kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, length, 8, generator=gen), torch.randn(batch, 3, length, 8, generator=gen)


def _same(ours: GrowingCache, reference: DynamicCache) -> None:
    for mine, theirs in zip(ours.layers, reference.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)
    assert ours.get_seq_length() == reference.get_seq_length()


def _both(caches, keys, values, layer=0):
    outs = [cache.update(keys, values, layer) for cache in caches]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


def test_updates_selections_and_assignments_match_dynamic_cache():
    ours, reference = GrowingCache(), DynamicCache()
    caches = (ours, reference)
    for layer in range(2):
        _both(caches, *_kv(4, 10, layer), layer)  # a prefill
    for step in range(40):  # decode steps, past the first buffer's room
        for layer in range(2):
            _both(caches, *_kv(4, 1, 100 + step * 2 + layer), layer)
    _same(ours, reference)
    rows = torch.tensor([0, 2, 2])  # rows leaving, a row shared
    for cache in caches:
        cache.batch_select_indices(rows)
    _same(ours, reference)
    for cache in caches:  # the sampler trims unused columns off the left by assignment
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, 5:], layer.values[:, :, 5:]
    for step in range(3):
        for layer in range(2):
            _both(caches, *_kv(3, 1, 500 + step * 2 + layer), layer)
    _same(ours, reference)
    for cache in caches:  # assigned again, then rows selected before any update
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
        cache.batch_select_indices(torch.tensor([2, 0]))
    _same(ours, reference)
    for layer in range(2):
        _both(caches, *_kv(2, 1, 900 + layer), layer)
    _same(ours, reference)


def test_a_decode_step_writes_in_place_until_the_room_is_used():
    cache = GrowingCache()
    cache.update(*_kv(2, 40, 0), 0)
    layer = cache.layers[0]
    start = (layer.keys.data_ptr(), layer.values.data_ptr())
    for step in range(48 - 40):  # the grid's next length past 40 is 48
        cache.update(*_kv(2, 1, step + 1), 0)
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == start
    assert layer.keys.shape[-2] == 48
    cache.update(*_kv(2, 1, 999), 0)  # full: a new buffer with room again
    assert layer.keys.data_ptr() != start[0]
    assert layer.keys.untyped_storage().nbytes() == 2 * 3 * 64 * 8 * 4
    cache.batch_select_indices(torch.tensor([1]))  # a row leaving: the rest keeps the room
    start = (layer.keys.data_ptr(), layer.values.data_ptr())
    cache.update(*_kv(1, 1, 1000), 0)
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == start
    assert layer.keys.untyped_storage().nbytes() == 1 * 3 * 64 * 8 * 4


def test_a_buffers_length_follows_the_filled_length_alone():
    """The grid (16, 24, 32, 48, 64, 96, ...), and the same buffer length for the same
    filled length whatever came before: a prefill of it, decode steps up to it, a batch
    merged (keys assigned) just before it. A bf16 row's decode numbers then depend on its
    length only: the CPU kernels' summation order follows the length they read."""
    grid = [capacity(n) for n in range(1, 3000)]
    assert sorted(set(grid))[:9] == [MIN_ROOM, 24, 32, 48, 64, 96, 128, 192, 256]
    assert all(n <= c <= max(MIN_ROOM, 1.5 * n) for n, c in zip(range(1, 3000), grid, strict=True))

    def buffer_length(steps):
        cache = GrowingCache()
        for kind, n in steps:
            if kind == "assign":  # as the sampler's merge does
                layer = cache.layers[0]
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            else:
                cache.update(*_kv(2, n, 0), 0)
        return buffer_of(cache.layers[0].keys).shape[2]

    for length in (20, 45, 70, 200):
        histories = [[("update", length)], [("update", 3)] + [("update", 1)] * (length - 3),
                     [("update", length - 2), ("assign", 0), ("update", 1), ("update", 1)]]
        assert {buffer_length(h) for h in histories} == {capacity(length)}, length


def test_the_views_name_their_buffers_whose_room_is_zeros(monkeypatch):
    """What a bf16 decode step relies on when it reads the whole buffers
    (``attention._over_buffers``): through growth and row selection, each view an update
    gives out names its buffer, which holds the view first and zeros after it (zeroed when
    first asked), until the next update writes past it."""
    poison_kv_room(monkeypatch)
    cache = GrowingCache()
    for step, (batch, length) in enumerate([(3, 40), (3, 1), *[(3, 1)] * MIN_ROOM * 2]):
        keys, values = cache.update(*_kv(batch, length, step), 0)
        layer = cache.layers[0]
        for view, buffer in ((keys, buffer_of(keys)), (values, buffer_of(values))):
            assert buffer is not None and buffer.shape[2] == capacity(view.shape[2])
            assert buffer.data_ptr() == view.data_ptr() and buffer.shape[:2] == view.shape[:2]
            assert torch.equal(buffer[:, :, :view.shape[2]], view)
            assert not buffer[:, :, view.shape[2]:].any()
    cache.batch_select_indices(torch.tensor([2, 0]))  # rows leaving keep room, still zeros
    keys, _ = cache.update(*_kv(2, 1, 99), 0)
    assert not buffer_of(keys)[:, :, keys.shape[2]:].any()
    assert buffer_of(layer.keys[:, :, 1:]) is None and buffer_of(keys.clone()) is None  # only the views given out
    cache.update(*_kv(2, 1, 100), 0)
    assert buffer_of(keys) is None  # an earlier step's view: the next position is written now


def test_a_layer_lets_its_buffers_go_when_its_tensors_are_replaced():
    """As the sampler's merge and trim do: the old buffers are freed then, not held until
    the layer's next update (nor by a bf16 step's reading them, ``buffer_of``)."""
    import gc
    import weakref

    cache = GrowingCache()
    cache.update(*_kv(2, 40, 0), 0)
    layer = cache.layers[0]
    assert buffer_of(layer.keys) is not None
    buffers = [weakref.ref(layer.keys._base), weakref.ref(layer.values._base)]  # the views' buffers
    layer.keys, layer.values = layer.keys[:, :, 3:].clone(), layer.values[:, :, 3:].clone()
    gc.collect()
    assert [b() for b in buffers] == [None, None]
    cache.update(*_kv(2, 1, 1), 0)  # and carries on from the assigned tensors
    assert layer.keys.shape[-2] == 38 and torch.equal(layer.keys[:, :, -1:], _kv(2, 1, 1)[0])
