"""Weight export (tier 2): versioned HF dir, broadcast to a separate receiver, in-process dict."""

from __future__ import annotations

import json

import pytest
import torch
from test_fsdp import (
    free_port,
    make_engine,
    n_loss_tokens,
    nll_loss,
    random_batch,
    set_dist_env,
    world_mesh,
)

from areal.api.config.engine import TrainEngineConfig
from areal.api.io import SaveLoadMeta, WeightUpdateMeta
from areal.engine.fsdp import FSDPEngine
from areal.utils import weight_sync
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
N_TRAINERS = 2  # FSDP ranks; the receiver is one more process outside their world


def _trainer_or_receiver(rank: int, path: str, ports: tuple[int, int], out: str) -> None:
    meta = WeightUpdateMeta(
        type="distributed", master_port=ports[1], bucket_bytes=200_000, version=4
    )
    if rank == N_TRAINERS:  # the "server": joins only the weight-update group, as group rank 1
        torch.set_num_threads(1)
        group = weight_sync.init_weight_update_group("127.0.0.1", ports[1], 1, 2, timeout=120)
        with open(
            out + ".json"
        ) as f:  # what the client would POST to /update_weights_from_distributed
            ann = json.load(f)
        specs = weight_sync.specs_from_announcement(ann["names"], ann["dtypes"], ann["shapes"])
        received = weight_sync.receive_weights(specs, group, meta.bucket_bytes, timeout=120)
        torch.save(received, out + ".received")
        return
    set_dist_env(rank, N_TRAINERS, ports[0])
    engine = make_engine(path)
    engine.train_batch(random_batch(seed=rank), nll_loss, n_loss_tokens)
    ann = engine.weight_announcement()
    if rank == 0:  # written before the group forms, so the receiver reads it complete
        with open(out + ".json", "w") as f:
            json.dump(ann, f)
    engine.init_weight_update_group(meta, world_size=2)
    engine.update_weights(meta)
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, out + ".sent")
    engine.destroy()


def test_broadcast_over_gloo_reproduces_every_tensor_in_a_receiver_process(
    tiny_model_dir, tmp_path
):
    out = str(tmp_path / "weights")
    run_ranks(
        _trainer_or_receiver, N_TRAINERS + 1, (tiny_model_dir, (free_port(), free_port()), out)
    )
    sent, received = torch.load(out + ".sent"), torch.load(out + ".received")
    # tied lm_head.weight is not sent (HF stores it once); everything else, bit for bit
    assert set(received) == set(sent) - {"lm_head.weight"}
    for name, tensor in received.items():
        assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), name


def test_disk_update_writes_a_versioned_hf_dir(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = make_engine(tiny_model_dir)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    target = tmp_path / "weights_v1"
    engine.update_weights(WeightUpdateMeta(type="disk", path=str(target), version=1))
    state = engine.full_state_dict()
    engine.destroy()
    assert json.loads((target / "areal_meta.json").read_text()) == {"version": 1}
    assert not (tmp_path / "weights_v1.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(target)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_full_state_dict_hands_over_every_parameter_in_process(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    engine = make_engine(tiny_model_dir)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    state = engine.full_state_dict()
    engine.set_version(2)
    assert engine.get_version() == 2
    engine.destroy()
    generator = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator.load_state_dict(state, strict=True)  # every HF name present, tied one included
    assert all(t.device.type == "cpu" for t in state.values())


def test_a_value_head_export_loads_as_what_it_is(tiny_model_dir, tmp_path):
    """A reward model / critic export names ForTokenClassification (score with bias), so
    transformers loads it whole instead of as a causal LM or a bias-less sequence classifier."""
    from transformers import AutoModelForTokenClassification

    cfg = TrainEngineConfig(path=tiny_model_dir)
    engine = FSDPEngine(cfg, world_mesh(), head="value")
    engine.initialize(None)
    engine.save(
        SaveLoadMeta(str(tmp_path / "rm"), weight_format="hf", tokenizer_path=tiny_model_dir)
    )
    engine.destroy()
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert (
        config["architectures"] == ["Qwen2ForTokenClassification"] and len(config["id2label"]) == 1
    )
    model, info = AutoModelForTokenClassification.from_pretrained(
        tmp_path / "rm", output_loading_info=True
    )
    assert not info["missing_keys"] and model.score.bias is not None
