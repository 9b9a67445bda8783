"""Samplers: which samples each data-parallel rank gets, and exact resumption from consumed samples."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.data.samplers import MegatronPretrainingSampler, MegatronRandomSampler, SamplerError


def test_pretraining_sampler_hands_each_rank_its_slice_of_each_chunk():
    # micro 2 × dp 3 = chunks of 6; rank 1 gets [2, 4) of each chunk.
    sampler = MegatronPretrainingSampler(20, 0, 2, 1, 3)
    assert list(sampler) == [[2, 3], [8, 9], [14, 15]]
    assert len(sampler) == 3
    ranks = [list(MegatronPretrainingSampler(20, 0, 2, r, 3)) for r in range(3)]
    seen = sorted(i for batches in ranks for batch in batches for i in batch)
    assert seen == list(range(18))


def test_pretraining_sampler_resumes_with_exactly_the_remaining_batches():
    full = list(MegatronPretrainingSampler(100, 0, 4, 0, 2))
    # After 5 steps of 8 samples the checkpoint records 40 consumed samples.
    resumed = list(MegatronPretrainingSampler(100, 40, 4, 0, 2))
    assert resumed == full[5:]
    assert resumed[0] == [40, 41, 42, 43]


def test_pretraining_sampler_last_partial_chunk_without_drop_last():
    # 10 samples in chunks of 4: the partial chunk [8, 10) holds rank 0's batch only; rank 1 gets [].
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6, 7], []]
    assert list(MegatronPretrainingSampler(11, 0, 2, 0, 2, drop_last=False))[-1] == [8, 9]
    assert list(MegatronPretrainingSampler(11, 0, 2, 1, 2, drop_last=False))[-1] == [10]


def test_pretraining_sampler_refuses_exhausted_or_bad_layout():
    with pytest.raises(SamplerError, match="consumed samples 10"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(SamplerError, match="rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(SamplerError, match="--micro-batch-size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)


def test_random_sampler_epoch_is_seeded_permutation_split_over_ranks():
    # 22 samples, micro 2 × dp 2: 5 chunks (20 samples) per epoch; 2 samples sit out each epoch.
    samplers = [MegatronRandomSampler(22, 0, 2, r, 2, seed=7) for r in range(2)]
    batches = [list(s) for s in samplers]
    generator = torch.Generator()
    generator.manual_seed(7)
    order = torch.randperm(22, generator=generator)[:20].tolist()
    assert batches[0] == [order[k * 4 : k * 4 + 2] for k in range(5)]
    assert batches[1] == [order[k * 4 + 2 : k * 4 + 4] for k in range(5)]
    assert samplers[0].consumed_samples == 20 and samplers[0].epoch == 1
    # The next iteration is epoch 1, permuted with seed + 1.
    generator.manual_seed(8)
    assert next(iter(samplers[0])) == torch.randperm(22, generator=generator)[:2].tolist()


def test_random_sampler_resumes_mid_epoch_and_across_epochs():
    reference = MegatronRandomSampler(30, 0, 3, 1, 2, seed=3)
    epochs = [list(reference) for _ in range(3)]
    assert all(len(e) == 5 for e in epochs)
    flat = [batch for epoch in epochs for batch in epoch]
    # 7 steps of 6 samples consumed: epoch 1, step 2.
    resumed = MegatronRandomSampler(30, 42, 3, 1, 2, seed=3)
    assert resumed.epoch == 1 and len(resumed) == 3
    assert list(resumed) + list(resumed) == flat[7:]
    assert epochs[0] != epochs[1]


def test_random_sampler_refuses_too_few_samples():
    with pytest.raises(SamplerError, match="cannot fill one step"):
        MegatronRandomSampler(3, 0, 2, 0, 2)
