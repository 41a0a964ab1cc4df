"""Weight-sync protocol: bucket planning by hand; real two-process gloo round trips (byte
buckets, SGLang's one broadcast per tensor, a broadcast that breaks off); tensors shared with
another process (the ipc mode's shared memory on CPU) and the handle unpickler's allowlist."""

from __future__ import annotations

import base64
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch

from areal.utils.network import free_port
from areal.utils.weight_sync import (
    SharedBuffer,
    TensorSpec,
    announcement,
    broadcast_each,
    broadcast_weights,
    init_weight_update_group,
    open_shared,
    plan_buckets,
    receive_weights,
    specs_from_announcement,
)
from tests.ranks import run_ranks


def share_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[SharedBuffer, dict]:
    """What the trainer's delivery loop does for ``ipc``: pack, then the payload to send."""
    shared = SharedBuffer(specs_from_announcement(**announcement(named)), named[0][1].device)
    for i, (_, t) in enumerate(named):
        shared.put(i, t)
    return shared, shared.payload()


def receive_each(specs: list[TensorSpec], group, timeout: float) -> dict[str, torch.Tensor]:
    """What SGLang's update_weights_from_distributed does: allocate each announced tensor, one
    broadcast from rank 0 into it."""
    out = {}
    for s in specs:
        out[s.name] = torch.empty(s.shape, dtype=s.dtype)
        group.broadcast(out[s.name], 0, timedelta(seconds=timeout)).wait()
    return out


def test_buckets_pack_consecutive_tensors_up_to_the_byte_limit():
    # fp32 sizes: 4*10=40 B, 4*20=80 B, 4*5=20 B, 4*100=400 B, 4*1=4 B; limit 100 B
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([10, 20, 5, 100, 1])]
    # 40 -> +80 = 120 > 100: new bucket; 80 + 20 = 100 <= 100: same; 400 alone; 4 new bucket
    assert plan_buckets(specs, 100) == [[0], [1, 2], [3], [4]]


def test_announcement_round_trips_names_dtypes_shapes():
    named = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4, dtype=torch.bfloat16))]
    specs = specs_from_announcement(**announcement(named))
    assert [(s.name, s.dtype, s.shape) for s in specs] == [
        ("a", torch.float32, (2, 3)),
        ("b", torch.bfloat16, (4,)),
    ]


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("w1", torch.randn(16, 8, generator=g)),
        ("b1", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("w2", torch.randn(3, 5, 7, generator=g)),
    ]


def _round_trip(rank: int, port: int, layout: str, out: str) -> None:
    """Rank 0 sends :func:`_named` (``layout``: buckets | each | none, the last sends nothing);
    rank 1 receives and saves what came, or the error."""
    torch.set_num_threads(1)
    named = _named()
    specs = specs_from_announcement(**announcement(named))
    group = init_weight_update_group("127.0.0.1", port, rank, 2, "gloo", timeout=30)
    if rank == 0:
        if layout == "buckets":
            broadcast_weights(named, group, bucket_bytes=256, timeout=30)
        elif layout == "each":
            broadcast_each(named, group, timeout=30)
        else:
            time.sleep(2.5)  # the receiver's 1 s deadline passes; then the sender goes
        return
    try:
        if layout == "each":
            got = receive_each(specs, group, timeout=30)
        else:
            got = receive_weights(specs, group, 256, timeout=30 if layout == "buckets" else 1.0)
        torch.save(got, out)
    except RuntimeError as e:
        torch.save(str(e), out)


@pytest.mark.parametrize("layout", ["buckets", "each"])
def test_gloo_broadcast_delivers_identical_tensors_between_processes(layout, tmp_path):
    out = str(tmp_path / "got.pt")
    run_ranks(_round_trip, 2, (free_port(), layout, out), timeout=90)
    got = torch.load(out)
    for name, tensor in _named():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_bucket_that_never_comes_raises_at_the_groups_deadline(tmp_path):
    out = str(tmp_path / "got.pt")
    run_ranks(_round_trip, 2, (free_port(), "none", out), timeout=90)
    assert "Timed out" in torch.load(out)


def _open_in_child(rank: int, payload: dict, out: str) -> None:
    torch.save([(n, t.clone()) for n, t in open_shared(payload)], out)


def test_shared_tensors_open_in_another_process_without_a_copy_through_disk(tmp_path):
    named = _named()  # fp32, bf16 of 16 elements (32 bytes: the next offset is aligned up), fp32
    buffer, payload = share_tensors(named)
    assert payload["devices"] == {} and payload["offsets"] == [0, 512, 576]  # 512 B, 32 -> 64 B
    assert buffer.buf.is_shared()
    out = str(tmp_path / "opened.pt")
    run_ranks(_open_in_child, 1, (payload, out), timeout=60)
    opened = torch.load(out)
    assert [n for n, _ in opened] == [n for n, _ in named]
    for (_, a), (_, b) in zip(opened, named):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(not t.is_shared() for _, t in named)  # the caller's tensors were copied, not moved


class _Boom:
    def __reduce__(self):  # os.system: a name no other test module rebinds (Ray swaps print)
        return (os.system, ("echo a request body ran code",))


def test_handles_naming_any_other_callable_or_a_wrong_layout_are_refused():
    _, payload = share_tensors(_named())
    evil = base64.b64encode(pickle.dumps(_Boom())).decode()
    with pytest.raises(ValueError, match="posix.system is not part of a tensor handle"):
        open_shared({**payload, "handles": evil})
    with pytest.raises(ValueError, match="handles: expected the base64 text"):
        open_shared({**payload, "handles": None})
    with pytest.raises(ValueError, match="offsets: "):
        open_shared({**payload, "offsets": [0, 0, 0]})
    with pytest.raises(ValueError, match="devices: expected"):
        open_shared({**payload, "devices": [1]})
