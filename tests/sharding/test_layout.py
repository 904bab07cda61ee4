"""Layout math and bucketing, without process groups."""

import pytest
import torch

from hf_zero.sharding.layout import ALIGN, FlatLayout, bucket_params


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_layout_pads_and_shards_cover_every_element_once(num_shards):
    shapes = [torch.Size([7, 3]), torch.Size([5]), torch.Size([11, 2, 2])]
    layout = FlatLayout(["a", "b", "c"], shapes, num_shards)
    assert layout.numel == 21 + 5 + 44
    assert layout.padded_numel % (num_shards * ALIGN) == 0
    assert 0 <= layout.padding < num_shards * ALIGN
    seen = torch.zeros(layout.numel, dtype=torch.int64)
    for shard in range(num_shards):
        start, end = layout.shard_range(shard)
        assert end - start == layout.shard_numel
        for piece in layout.shard_pieces(shard):
            flat_start = piece.slot.offset + piece.param_start
            assert flat_start - start == piece.shard_start
            seen[flat_start : flat_start + piece.numel] += 1
    assert torch.equal(seen, torch.ones_like(seen))


def test_buckets_respect_size_key_and_order():
    params = [torch.empty(n) for n in (30, 30, 50, 200, 10, 10)]
    keys = [0, 1, 0, 0, 1, 0]
    buckets = bucket_params(list(zip(keys, params)), bucket_numel=60)
    sizes = [(key, [p.numel() for p in members]) for key, members in buckets]
    # key 0: [30] then 50 would overflow -> [50], 200 alone (larger than a bucket), [10]
    # key 1: [30, 10]; buckets ordered by the position of their last parameter (completion)
    assert sizes == [(0, [30]), (0, [50]), (0, [200]), (1, [30, 10]), (0, [10])]
    flat = [id(p) for _, members in buckets for p in members]
    assert sorted(flat) == sorted(id(p) for p in params)
