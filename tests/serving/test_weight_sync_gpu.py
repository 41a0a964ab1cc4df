"""Tier 3: the weight updates only a GPU runs, against ``areal serve`` in its own process - an
NCCL broadcast (the server on a second GPU: NCCL refuses two ranks on one device) and the
colocated update by CUDA IPC handles (the server on the trainer's GPU: no byte through the
host). Each must give the next-token logprobs of a disk update of the same weights."""

from __future__ import annotations

import threading

import pytest
import torch

from areal.serving.model import read_hf_dir
from areal.utils import weight_sync
from areal.utils.network import free_port
from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_server import call

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 99, 200, 3]


def _greedy(url: str) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True}  # fmt: skip
    out = call(f"{url}/generate", body)[1]
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def _disk_reference(url: str, model_dir: str) -> tuple[list[int], list[float]]:
    status, _ = call(f"{url}/update_weights_from_disk", {"model_path": model_dir})
    assert status == 200
    return _greedy(url)


def test_nccl_broadcast_to_our_server_on_another_gpu_equals_a_disk_update(
    tiny_model_dir, other_model_dir
):
    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL broadcast needs the server on a second GPU")
    procs = start_servers(tiny_model_dir, 1, "device=cuda:1")
    url = f"http://{procs[0][1]}"
    try:
        before = _greedy(url)
        port = free_port()
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "backend": "nccl", "timeout": 120}  # fmt: skip
        joined: dict = {}
        t = threading.Thread(
            target=lambda: joined.update(r=call(f"{url}/init_weights_update_group", body))
        )
        t.start()
        group = weight_sync.init_weight_update_group("127.0.0.1", port, 0, 2, "nccl", 120)
        t.join(120)
        assert joined["r"][0] == 200, joined
        named = [(n, p.to("cuda:0")) for n, p in sorted(read_hf_dir(other_model_dir)[1].items())]
        upd = {**weight_sync.announcement(named), "bucket_bytes": 1 << 20, "weight_version": 9}
        answer: dict = {}
        t = threading.Thread(
            target=lambda: answer.update(r=call(f"{url}/update_weights_from_distributed", upd))
        )
        t.start()
        weight_sync.broadcast_weights(named, group, 1 << 20, timeout=120)
        t.join(120)
        assert answer["r"][0] == 200 and answer["r"][1]["weight_version"] == 9, answer
        weight_sync.destroy_weight_update_group(group)
        over_nccl = _greedy(url)
        assert over_nccl[0] != before[0]
        assert over_nccl == _disk_reference(url, other_model_dir)
    finally:
        stop_servers(procs)


def test_cuda_ipc_update_of_a_colocated_server_equals_a_disk_update(
    tiny_model_dir, other_model_dir
):
    procs = start_servers(tiny_model_dir, 1, "device=cuda:0")
    url = f"http://{procs[0][1]}"
    try:
        before = _greedy(url)
        named = [(n, p.to("cuda:0")) for n, p in sorted(read_hf_dir(other_model_dir)[1].items())]
        specs = weight_sync.specs_from_announcement(**weight_sync.announcement(named))
        buffer = weight_sync.SharedBuffer(specs, torch.device("cuda:0"))
        for i, (_, t) in enumerate(named):
            buffer.put(i, t)
        payload = buffer.payload()
        assert buffer.buf.is_cuda and list(payload["devices"]) == ["0"]  # GPU memory's handle
        status, out = call(f"{url}/update_weights_from_ipc", {**payload, "weight_version": 4})
        assert status == 200 and out["weight_version"] == 4, out
        over_ipc = _greedy(url)
        assert over_ipc[0] != before[0]
        assert over_ipc == _disk_reference(url, other_model_dir)
    finally:
        stop_servers(procs)
