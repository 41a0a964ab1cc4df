"""The trainer's whole weight push (tier 2): a real FSDP engine (one gloo rank, in process), the
weight publisher, the HTTP client and our server in its own process. Each mode - ``ipc`` (shared
memory on CPU), ``distributed`` (the gloo broadcast) and ``disk`` - must leave the server with
the same next-token distributions, token for token."""

from __future__ import annotations

import pytest
import torch

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.io import ModelRequest
from areal.engine.fsdp import FSDPEngine
from areal.rollout.remote import RemoteInferenceEngine
from areal.runtime.dist import init_distributed
from areal.runtime.publisher import WeightPublisher
from tests.serving.servers import start_servers, stop_servers

pytestmark = pytest.mark.slow
PROMPT = [2, 7, 1, 30, 4]


class Admission:
    """No rollouts run here: pause/resume only record the version."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        self.versions.append(version)


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory) -> str:
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_new"), size="tiny", seed=1))


def _greedy(client: RemoteInferenceEngine):
    import asyncio

    g = GenerationHyperparameters(max_new_tokens=8, greedy=True, ignore_eos=True)
    out = asyncio.run(client.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
    return out.output_ids, out.output_logprobs, out.output_versions


def test_ipc_broadcast_and_disk_pushes_give_the_server_the_same_next_token_logprobs(
    tiny_model_dir, new_weights_dir, tmp_path
):
    procs = start_servers(tiny_model_dir, 1)
    client = RemoteInferenceEngine(
        InferenceEngineConfig(setup_timeout=60, weight_update_timeout=60)
    )
    ctx = init_distributed("gloo")
    actor = FSDPEngine(TrainEngineConfig(path=new_weights_dir), ctx.mesh)
    try:
        client.initialize([procs[0][1]])
        actor.initialize(None)
        before = _greedy(client)
        seen = {}
        for version, mode in enumerate(["ipc", "distributed", "disk"], start=1):
            actor.set_version(version - 1)  # the publisher starts from the actor's version
            pub = WeightPublisher(mode, actor, client, Admission(), ctx, tmp_path / mode)
            assert pub.publish() == version
            ids, logprobs, versions = _greedy(client)
            assert versions == [version] * 8
            seen[mode] = (ids, logprobs)
            pub.close()
        assert seen["ipc"] == seen["distributed"] == seen["disk"]
        assert seen["disk"][0] != before[0]  # the new weights are the ones in use
    finally:
        actor.destroy()
        client.destroy()
        stop_servers(procs)
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # restored
