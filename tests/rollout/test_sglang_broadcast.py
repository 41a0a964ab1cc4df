"""The trainer -> SGLang broadcast (tier 2), against a fake SGLang (tests/rollout/fake_sglang.py:
a process that records the HTTP requests and receives over gloo as SGLang does, one broadcast
per tensor). A real SGLang is CUDA-only and is not run here. The trainer side is real: an FSDP
engine (one gloo rank), the weight publisher and the HTTP client with ``backend=sglang``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from areal.api.config.engine import TrainEngineConfig
from areal.api.config.rollout import InferenceEngineConfig
from areal.engine.fsdp import FSDPEngine
from areal.rollout.remote import RemoteInferenceEngine
from areal.runtime.dist import init_distributed
from areal.runtime.publisher import WeightPublisher
from areal.utils.network import free_port

pytestmark = pytest.mark.slow
# InitWeightsUpdateGroupReqInput / UpdateWeightsFromDistributedReqInput (sglang io_struct)
SGLANG_INIT = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "group_name",
    "backend",
}
SGLANG_UPDATE = {
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
    "weight_version", "load_format", "torch_empty_cache",
}  # fmt: skip


class Admission:
    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        pass


def test_the_trainer_broadcasts_one_tensor_at_a_time_with_sglangs_requests(
    tiny_model_dir, tmp_path
):
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "tests.rollout.fake_sglang", str(port),
                             str(tmp_path)])  # fmt: skip
    client = RemoteInferenceEngine(InferenceEngineConfig(backend="sglang", setup_timeout=60))
    ctx = init_distributed("gloo")
    actor = FSDPEngine(TrainEngineConfig(path=tiny_model_dir), ctx.mesh)
    try:
        client.initialize([f"127.0.0.1:{port}"])
        actor.initialize(None)
        pub = WeightPublisher("distributed", actor, client, Admission(), ctx, tmp_path / "w")
        assert pub.publish() == 1
        sent = actor.full_state_dict()
    finally:
        actor.destroy()
        client.destroy()
        fake.kill()
        fake.wait(10)
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    (init,) = [r["body"] for r in requests if r["path"] == "/init_weights_update_group"]
    (update,) = [r["body"] for r in requests if r["path"] == "/update_weights_from_distributed"]
    assert set(init) == SGLANG_INIT and init["backend"] == "gloo" and init["rank_offset"] == 1
    assert set(update) <= SGLANG_UPDATE and update["weight_version"] == "1"
    received = torch.load(tmp_path / "received.pt")
    # tied lm_head.weight is not sent (HF stores it once); everything else, bit for bit
    assert list(received) == update["names"] and set(received) == set(sent) - {"lm_head.weight"}
    for name, tensor in received.items():
        assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), name
