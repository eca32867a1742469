"""shard(): this rank's part of each array, cut alike across several arrays, type preserved."""

from __future__ import annotations

from typing import Any

from skytasks.rank import in_rank, rank_info


def _indices(n: int, node: int, total: int, shuffle: bool, seed: int, drop_last: bool) -> list[int]:
    if shuffle:
        import numpy as np

        # The same seed on every rank gives the same permutation, so the shares stay disjoint.
        order = np.random.default_rng(seed).permutation(n).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[: (n // total) * total]
    # Contiguous, balanced blocks: the first len % total ranks get one item more.
    size, extra = divmod(len(order), total)
    start = node * size + min(node, extra)
    return order[start : start + size + (1 if node < extra else 0)]


def _take(array: Any, idx: list[int]) -> Any:
    if isinstance(array, list):
        return [array[i] for i in idx]
    if isinstance(array, tuple):
        return tuple(array[i] for i in idx)
    mod = type(array).__module__
    if mod.startswith("torch"):
        import torch

        return array[torch.as_tensor(idx, dtype=torch.long, device=array.device)]
    if mod.startswith("numpy"):
        import numpy as np

        return array[np.asarray(idx, dtype=np.int64)]
    if hasattr(array, "iloc"):  # pandas
        return array.iloc[idx]
    if hasattr(array, "__getitem__") and hasattr(array, "__len__"):
        items = [array[i] for i in idx]
        try:
            return type(array)(items)
        except Exception:  # noqa: BLE001
            return items
    raise TypeError(f"shard: cannot cut a {type(array).__qualname__}; give lists, tuples, numpy arrays or tensors")


def shard(*arrays: Any, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
          node: int | None = None, total: int | None = None) -> Any:
    """This rank's share of each array. One array in, one out; several in, a tuple out.

    Inside a rank, `node` and `total` default to the rank and world size; outside one, pass
    both. With `drop_last` every share has the same length.
    """
    if not arrays:
        raise TypeError("shard: give at least one array")
    if node is None or total is None:
        if not in_rank():
            raise RuntimeError("shard: outside a rank, pass both node= and total=")
        info = rank_info()
        node = info.rank if node is None else node
        total = info.world_size if total is None else total
    if total < 1 or not 0 <= node < total:
        raise ValueError(f"shard: node={node} must be in [0, total={total})")
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ValueError(f"shard: the arrays must have the same length, got {sorted(lengths)}")
    idx = _indices(lengths.pop(), node, total, shuffle, seed, drop_last)
    parts = tuple(_take(a, idx) for a in arrays)
    return parts[0] if len(parts) == 1 else parts
