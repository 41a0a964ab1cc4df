"""Weight-sync protocol: bucket planning by hand, and a real two-rank gloo round trip."""

from __future__ import annotations

import socket
import threading

import torch

from areal.utils.weight_sync import (
    TensorSpec,
    announcement,
    broadcast_weights,
    init_weight_update_group,
    plan_buckets,
    receive_weights,
    specs_from_announcement,
)


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


def test_gloo_broadcast_delivers_identical_tensors_in_small_buckets():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = torch.Generator().manual_seed(0)
    named = [
        ("w1", torch.randn(16, 8, generator=g)),
        ("b1", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("w2", torch.randn(3, 5, 7, generator=g)),
    ]
    specs = specs_from_announcement(**announcement(named))
    received: dict = {}

    def receiver() -> None:
        group = init_weight_update_group("127.0.0.1", port, 1, 2, "gloo", timeout=30)
        received.update(receive_weights(specs, group, bucket_bytes=256, timeout=30))

    t = threading.Thread(target=receiver)
    t.start()
    group = init_weight_update_group("127.0.0.1", port, 0, 2, "gloo", timeout=30)
    broadcast_weights(named, group, bucket_bytes=256, timeout=30)
    t.join(30)
    assert not t.is_alive()
    for name, tensor in named:
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor)
