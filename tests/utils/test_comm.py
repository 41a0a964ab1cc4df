"""The collective door (areal/utils/comm.py): a group serves only its backends' device types.

A backend registered for ``cuda`` only stands in for NCCL on this CPU machine: torch refuses a
CPU tensor on it exactly as NCCL does on a GPU ("No backend type associated with device type
cpu"), which is how every Lite run crashed at its first stats export on an H200.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from areal.runtime.dist import group_backend
from areal.utils import comm
from areal.utils.stats import StatsTracker


def _gloo(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@pytest.fixture(scope="module")
def groups():
    """A one-rank job with a cuda-only group (NCCL's shape) and a cpu+cuda group (ours on GPUs)."""
    if "fakecuda" not in dist.Backend.backend_list:
        dist.Backend.register_backend("fakecuda", _gloo, devices=["cuda"])
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cuda_only = dist.new_group([0], backend="fakecuda")
    both = dist.new_group([0], backend="cpu:gloo,cuda:fakecuda")
    yield cuda_only, both
    if mine:
        dist.destroy_process_group()


def test_all_reduce_refuses_a_tensor_whose_device_the_group_cannot_serve(groups):
    cuda_only, _ = groups
    with pytest.raises(
        ValueError,
        match=r"a cpu tensor cannot go through process group 'fakecuda', "
        r"which serves cuda; move it to cuda first",
    ):
        comm.all_reduce(torch.ones(2), group=cuda_only)


def test_stats_export_on_a_cuda_only_group_never_hands_it_a_host_tensor(groups):
    # Without CUDA in this process the host values cannot be staged: a clear refusal before any
    # collective, instead of torch's "No backend type associated with device type cpu" from
    # inside it.
    cuda_only, _ = groups
    tracker = StatsTracker()
    tracker.mean("reward", torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="serves only cuda, which this process does not have"):
        tracker.export(group=cuda_only)


def test_groups_built_for_gpus_reduce_host_stats_on_the_cpu(groups):
    _, both = groups
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl" and group_backend("gloo") == "gloo"
    assert comm.group_device_types(both) == ("cpu", "cuda")
    assert comm.group_device(both) == torch.device("cpu")
    tracker = StatsTracker()
    tracker.mean("reward", torch.tensor([1.0, 0.0, 1.0]))  # 2 over 3 samples
    tracker.max("len", torch.tensor([3.0, 7.0]))
    assert tracker.export(group=both) == {"reward": pytest.approx(2 / 3), "len": 7.0}


def test_all_reduce_sums_over_a_group_that_serves_the_device(groups):
    _, both = groups
    t = torch.tensor([1.0, 2.0])
    assert comm.all_reduce(t, group=both) is t and t.tolist() == [1.0, 2.0]  # one rank: unchanged


def _nccl_only_export(rank: int, port: int, out: str) -> None:
    import json
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    tracker = StatsTracker()
    tracker.mean("reward", torch.tensor([1.0, 0.0, 1.0], device="cuda"))
    tracker.max("len", torch.tensor([3.0, 7.0]))
    refused = ""
    try:
        comm.all_reduce(torch.ones(2), group=None)
    except ValueError as e:
        refused = str(e)
    with open(out, "w") as f:
        json.dump(
            {"stats": tracker.export(), "device": str(comm.group_device(None)), "refused": refused},
            f,
        )
    dist.destroy_process_group()


@pytest.mark.gpu
def test_stats_export_on_an_nccl_only_group_on_a_gpu(tmp_path):
    import json

    import torch.multiprocessing as mp

    from areal.utils.network import free_port

    out = tmp_path / "out.json"
    mp.start_processes(
        _nccl_only_export, args=(free_port(), str(out)), nprocs=1, start_method="spawn"
    )
    got = json.loads(out.read_text())
    assert (
        got["stats"] == {"reward": pytest.approx(2 / 3), "len": 7.0} and got["device"] == "cuda:0"
    )
    assert "a cpu tensor cannot go through process group 'nccl'" in got["refused"]
