"""Stochastic rounding to bf16 (`hf_zero.numerics.rounding`): unbiased, reproducible, and the
same bits for an element whatever range of the shard it is rounded in."""

import torch

from hf_zero.numerics.rounding import NOISE_BLOCK, ShardRounding, to_bf16_stochastic


def test_a_shard_rounded_in_tiles_equals_it_rounded_whole():
    values = torch.randn(2 * NOISE_BLOCK + 5000)
    whole = to_bf16_stochastic(values, seed=7)
    for tile in (2048, 3000, NOISE_BLOCK + 1):  # within a block, across blocks, unaligned
        parts = [
            to_bf16_stochastic(values[start : start + tile], seed=7, offset=start)
            for start in range(0, values.numel(), tile)
        ]
        assert torch.equal(torch.cat(parts), whole), tile
    assert not torch.equal(to_bf16_stochastic(values, seed=8), whole)  # the seed matters


def test_rounding_is_unbiased_and_keeps_what_bf16_holds():
    # 1 + 2^-9 lies a quarter of the way from 1 to the next bf16, 1 + 2^-7: rounded to nearest
    # it is always 1; stochastically it is 1 + 2^-7 a quarter of the time, and the mean is kept.
    target = 1.0 + 2**-9
    rounded = to_bf16_stochastic(torch.full((1 << 20,), target), seed=3).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - target) < 2e-5
    exact = torch.tensor([0.0, -2.5, 1.0, float("inf"), float("-inf")])
    assert torch.equal(to_bf16_stochastic(exact, seed=1).float(), exact)
    assert to_bf16_stochastic(torch.tensor([float("nan")]), seed=1).isnan().all()


def test_each_step_draws_new_bits_and_a_resumed_count_the_same():
    values = torch.randn(4096)
    first, later = ShardRounding(salt=11), ShardRounding(salt=11)
    first.begin_step()
    step_one = first.round(values, {})
    first.begin_step()
    assert not torch.equal(first.round(values, {}), step_one)  # a new count, new bits
    later.begin_step()
    assert torch.equal(later.round(values, {}), step_one)
    # The optimizer's own step count, where it keeps one, is what seeds the bits.
    assert torch.equal(first.round(values, {"step": torch.tensor(1.0)}), step_one)
