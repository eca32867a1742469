"""shard(): every rank's share, cut alike across arrays, with the contract's properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skytasks import shard


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), total=st.integers(1, 17), shuffle=st.booleans(), seed=st.integers(0, 2**31), drop_last=st.booleans())
def test_shares_are_disjoint_and_cover_everything(n, total, shuffle, seed, drop_last):
    data = list(range(n))
    shares = [shard(data, node=r, total=total, shuffle=shuffle, seed=seed, drop_last=drop_last) for r in range(total)]
    flat = [x for s in shares for x in s]
    assert len(flat) == len(set(flat))  # disjoint
    if drop_last:
        assert len({len(s) for s in shares}) == 1  # every rank the same length
        assert len(flat) == (n // total) * total  # only the remainder is dropped
    else:
        assert sorted(flat) == data  # together they cover everything
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 100), total=st.integers(1, 8), seed=st.integers(0, 1000))
def test_several_arrays_are_cut_alike_and_keep_their_types(n, total, seed):
    xs = list(range(n))
    tup = tuple(f"s{i}" for i in range(n))
    arr = np.arange(n) * 10
    ten = torch.arange(n) * 100
    for r in range(total):
        a, b, c, d = shard(xs, tup, arr, ten, node=r, total=total, shuffle=True, seed=seed)
        assert isinstance(a, list) and isinstance(b, tuple)
        assert isinstance(c, np.ndarray) and isinstance(d, torch.Tensor)
        assert [f"s{i}" for i in a] == list(b)
        assert (c == np.array(a) * 10).all() and torch.equal(d, torch.tensor(a, dtype=torch.long) * 100)


def test_shuffle_is_seeded_the_same_everywhere_and_changes_with_the_seed():
    data = list(range(50))
    assert shard(data, node=1, total=3, shuffle=True, seed=7) == shard(data, node=1, total=3, shuffle=True, seed=7)
    assert shard(data, node=1, total=3, shuffle=True, seed=7) != shard(data, node=1, total=3, shuffle=True, seed=8)
    assert shard(data, node=0, total=2) == list(range(25))  # no shuffle: contiguous blocks


def test_bad_calls_say_what_is_wrong():
    with pytest.raises(ValueError, match="same length"):
        shard([1, 2], [1], node=0, total=1)
    with pytest.raises(ValueError, match="node=3"):
        shard([1, 2], node=3, total=2)
    with pytest.raises(RuntimeError, match="outside a rank"):
        shard([1, 2])
