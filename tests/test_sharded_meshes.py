"""Sharded checkpoints of the other meshes the contract names, on real gloo ranks (CPU): HSDP on a
2 x 2 mesh `(replicate, shard)` restored as plain FSDP2 on a 1-D mesh of 2 ranks, and tensor
parallelism (`parallelize_module`, colwise then rowwise) on 4 ranks restored with the same plan on
2. Every parameter and every Adam moment, gathered whole, is what was saved.

The pools are shared by the module's tests (`with pool:`), so ranks start once per pool; the
leak check runs when the module's pools are down instead of after each test.
"""

from __future__ import annotations

from skytasks import distributed_task
from tests.harness.workloads import whole

# conftest's `pools` (four, two) stay up between this module's tests: its leak check runs once they are down.
POOLS_STAY_UP = True


# -- what the ranks run ------------------------------------------------------------------------

def fsdp_model(seed: int, mesh):
    """FSDP2 over `mesh`: 1-D is plain FSDP2, 2-D `(replicate, shard)` is HSDP."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def tp_model(seed: int, mesh):
    """A small MLP, tensor parallel over `mesh`: the first linear colwise, the second rowwise."""
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model, opt, steps: int, same_input: bool) -> None:
    """Data parallel ranks see their own batches; tensor parallel ranks all see the same one."""
    import torch
    import torch.distributed as dist

    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + (0 if same_input else dist.get_rank()))
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def placements(model) -> dict:
    return {k: tuple(repr(p) for p in v.placements) for k, v in model.state_dict().items()}


def save(model, opt, path: str, step: int) -> dict:
    from skytasks import Checkpointer

    ckpt = Checkpointer(path)
    ckpt.save({"model": model, "optim": opt}, step)
    ckpt.wait()
    return {"values": whole(model, opt), "placements": placements(model)}


def restore(model, opt, path: str) -> dict:
    import torch.distributed as dist

    from skytasks import Checkpointer

    step = Checkpointer(path).restore({"model": model, "optim": opt})
    return {"step": step, "world": dist.get_world_size(), "values": whole(model, opt),
            "placements": placements(model)}


def hsdp_save(path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = fsdp_model(0, mesh)
    train(model, opt, 3, same_input=False)
    return save(model, opt, path, 3)


def fsdp_restore(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = fsdp_model(1, init_device_mesh("cpu", (dist.get_world_size(),)))  # other values, same shapes
    return restore(model, opt, path)


def tp_save(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = tp_model(0, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)))
    train(model, opt, 3, same_input=True)
    return save(model, opt, path, 3)


def tp_restore(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = tp_model(1, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)))
    return restore(model, opt, path)


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_saved_alike(saved: list[dict]) -> dict:
    """Every rank gathered the same whole values: 4 parameters, and Adam's step, exp_avg and
    exp_avg_sq of each."""
    values = saved[0]["values"]
    assert len(values) == 4 + 3 * 4
    for s in saved:
        assert_same(s["values"], values)
    return values


# -- the tests ---------------------------------------------------------------------------------

def test_hsdp_on_a_2x2_mesh_restored_as_fsdp2_on_2_ranks(pools, tmp_path):
    where = str(tmp_path / "ckpt")
    saved = distributed_task(hsdp_save, pool=pools["four"])(where)
    assert len(saved) == 4
    assert set(saved[0]["placements"].values()) == {("Replicate()", "Shard(dim=0)")}  # HSDP indeed
    values = assert_saved_alike(saved)

    restored = distributed_task(fsdp_restore, pool=pools["two"])(where)
    assert len(restored) == 2
    for r in restored:
        assert (r["step"], r["world"]) == (3, 2)
        assert set(r["placements"].values()) == {("Shard(dim=0)",)}  # plain FSDP2 on a 1-D mesh
        assert_same(r["values"], values)


def test_tensor_parallel_on_4_ranks_restored_with_the_same_plan_on_2(pools, tmp_path):
    where = str(tmp_path / "ckpt")
    saved = distributed_task(tp_save, pool=pools["four"])(where)
    assert len(saved) == 4
    tp_placements = {"0.weight": ("Shard(dim=0)",), "0.bias": ("Shard(dim=0)",),  # colwise
                     "2.weight": ("Shard(dim=1)",), "2.bias": ("Replicate()",)}  # rowwise
    assert saved[0]["placements"] == tp_placements
    values = assert_saved_alike(saved)

    restored = distributed_task(tp_restore, pool=pools["two"])(where)
    assert len(restored) == 2
    for r in restored:
        assert (r["step"], r["world"]) == (3, 2)
        assert r["placements"] == tp_placements
        assert_same(r["values"], values)
