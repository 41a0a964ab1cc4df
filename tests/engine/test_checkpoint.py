"""Save/load (tier 2): DCP round trip is bitwise; HF export reloads in plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_fsdp import (
    LENGTHS,
    free_port,
    make_engine,
    n_loss_tokens,
    nll_loss,
    random_batch,
    set_dist_env,
    world_mesh,
)
from torch.distributed.tensor import DTensor

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.io import FinetuneSpec, SaveLoadMeta
from areal.engine.fsdp import FSDPEngine
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
SCHEDULE = OptimizerConfig(lr=1e-3, lr_scheduler_type="cosine", warmup_steps_proportion=0.2)


def build(path: str) -> FSDPEngine:
    cfg = TrainEngineConfig(
        path=path, mb_spec=MicroBatchSpec(max_tokens_per_mb=40), optimizer=SCHEDULE
    )
    engine = FSDPEngine(cfg, world_mesh())
    engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1))
    return engine


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_tensors(engine: FSDPEngine) -> list[torch.Tensor]:
    return [
        local(v)
        for state in engine.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


def test_dcp_round_trip_is_bitwise_and_next_step_identical(tiny_model_dir, tmp_path):
    a = build(tiny_model_dir)
    for seed in range(2):
        a.train_batch(random_batch(seed=seed), nll_loss, n_loss_tokens)
        a.step_lr_scheduler()
    a.set_version(3)
    a.save(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))

    b = build(tiny_model_dir)
    b.load(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    assert b.get_version() == 3 and b.lr_scheduler.state_dict() == a.lr_scheduler.state_dict()
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(local(pa), local(pb)), name
    opt_a, opt_b = optimizer_tensors(a), optimizer_tensors(b)
    assert len(opt_a) == len(opt_b) > 0
    assert all(torch.equal(x, y) for x, y in zip(opt_a, opt_b))

    next_batch = random_batch(seed=7)
    stats_a = a.train_batch(next_batch, nll_loss, n_loss_tokens)
    stats_b = b.train_batch(next_batch, nll_loss, n_loss_tokens)
    assert stats_a == stats_b
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(local(pa), local(pb))
    b.destroy()
    a.destroy()


def test_hf_export_reloads_in_plain_transformers_with_identical_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = build(tiny_model_dir)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    engine.set_version(5)
    out = tmp_path / "hf"
    engine.save(SaveLoadMeta(path=str(out), weight_format="hf"))
    state = engine.full_state_dict()
    batch = random_batch(LENGTHS[:1])
    engine_logits = engine.forward(batch, lambda logits, mb: logits)  # [T, V]
    engine.destroy()

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"][None]).logits[0]
    assert (plain - engine_logits).abs().max().item() < 1e-5
    assert json.loads((out / "areal_meta.json").read_text()) == {"version": 5}
    text = "<|im_start|>user\nhi<|im_end|>"
    assert AutoTokenizer.from_pretrained(out).encode(text) == AutoTokenizer.from_pretrained(
        tiny_model_dir
    ).encode(text)


def test_hf_load_into_a_fresh_engine_restores_the_weights(tiny_model_dir, tmp_path):
    a = build(tiny_model_dir)
    a.train_batch(random_batch(), nll_loss, n_loss_tokens)
    a.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    saved = a.full_state_dict()
    a.destroy()
    b = build(tiny_model_dir)
    b.load(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    loaded = b.full_state_dict()
    b.destroy()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


# ------------------------------------------- recover checkpoints of a run (make_run: conftest)


def test_dcp_shard_with_4kib_overwritten_resumes_from_the_previous_checkpoint(
    tiny_model_dir, make_run, caplog
):
    import logging

    run = make_run()
    a = build(tiny_model_dir)
    a.train_batch(random_batch(seed=0), nll_loss, n_loss_tokens)
    run.save_recover(1, {"actor": a}, {"note": "one"})
    params_1 = [local(p).clone() for p in a.model.parameters()]
    optim_1 = [t.clone() for t in optimizer_tensors(a)]
    a.train_batch(random_batch(seed=1), nll_loss, n_loss_tokens)
    run.save_recover(2, {"actor": a}, {"note": "two"})
    a.destroy()
    shard = next((run.run_dir / "recover" / "ckpt-2" / "actor").glob("*.distcp"))
    with open(shard, "r+b") as f:  # the size stays: today this loads, with garbage in the state
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)

    b = build(tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="areal.recover"):
        state = run.load_recover({"actor": b})
    assert state["step"] == 1 and state["note"] == "one"
    assert f"ckpt-2 is corrupt: actor/{shard.name}: content does not match" in caplog.text
    assert all(torch.equal(local(p), q) for p, q in zip(b.model.parameters(), params_1))
    assert all(torch.equal(x, y) for x, y in zip(optimizer_tensors(b), optim_1))
    b.destroy()


def test_truncated_dcp_files_fail_with_an_error_naming_the_checkpoint_and_file(
    tiny_model_dir, tmp_path
):
    from areal.utils.recover import CheckpointError

    a = build(tiny_model_dir)
    for name in ("shard", "rank"):
        a.save(SaveLoadMeta(path=str(tmp_path / name), weight_format="dcp", with_optim=True))
    a.destroy()
    shard = next((tmp_path / "shard").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    rank_file = tmp_path / "rank" / "areal_rank0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])

    b = build(tiny_model_dir)
    with pytest.raises(
        CheckpointError,
        match=f"DCP checkpoint {tmp_path / 'shard'} is unreadable \\(its files: .*{shard.name}",
    ):
        b.load(SaveLoadMeta(path=str(tmp_path / "shard"), weight_format="dcp", with_optim=True))
    with pytest.raises(CheckpointError, match=f"{rank_file} is unreadable"):
        b.load(SaveLoadMeta(path=str(tmp_path / "rank"), weight_format="dcp", with_optim=True))
    b.destroy()


def test_refused_resume_leaves_config_yaml_byte_identical_and_ends_with_one_message(make_run):
    first = make_run("seed=1")
    first.save_recover(1, {}, {"note": "one"})
    config = first.run_dir / "config.yaml"
    original = config.read_bytes()
    state_file = first.run_dir / "recover" / "ckpt-1" / "state-rank0.pt"
    state_file.write_bytes(state_file.read_bytes()[:10])  # the only checkpoint is corrupt

    second = make_run("seed=2")  # today: config.yaml is rewritten here, before the resume
    with pytest.raises(SystemExit) as e:  # was a 20-line traceback ending in the message
        second.load_recover({})
    message = e.value.code  # what Python prints, alone, for an uncaught SystemExit
    assert message.startswith(
        f"RecoverError: cannot resume: none of the 1 recover checkpoint(s) in "
        f"{first.run_dir / 'recover'} is usable; to start the run fresh, delete "
    ), message
    assert "ckpt-1: state-rank0.pt: 10 bytes" in message and "\n" not in message
    assert config.read_bytes() == original


def test_accepted_resume_writes_the_new_config_yaml(make_run):
    first = make_run("seed=1")
    first.save_recover(1, {}, {"note": "one"})
    second = make_run("seed=2")
    config = second.run_dir / "config.yaml"
    assert "\nseed: 1\n" in config.read_text()  # not rewritten before the resume is accepted
    assert second.load_recover({})["note"] == "one"
    assert "\nseed: 2\n" in config.read_text()


def _two_rank_resume(rank: int, path: str, port: int, out: str) -> None:
    """Rank ``rank`` of a 2-rank job: save recover checkpoints of steps 1 and 2, let rank 0
    corrupt one DCP shard of step 2, then resume into a fresh engine; write what it loaded."""
    from areal.api.config import SFTConfig, load_config
    from areal.api.launch import LaunchEnv
    from areal.runtime.dist import close_distributed, init_distributed
    from areal.runtime.run import Run

    set_dist_env(rank, 2, port)
    ctx = init_distributed("gloo")
    cfg = load_config(
        SFTConfig,
        [
            f"fileroot={out}",
            "recover.mode=resume",
            f"model.path={path}",
            "cluster.n_servers=0",
            "train_dataset.type=sft",
            "stats_logger.console=false",
        ],
    )
    run = Run(cfg, ctx, LaunchEnv.read(), tokenizer=None)
    a = make_engine(path, mesh=ctx.mesh)
    a.train_batch(random_batch(seed=rank), nll_loss, n_loss_tokens)
    run.save_recover(1, {"actor": a}, {"rank": rank})
    saved = {k: v.clone() for k, v in a.full_state_dict().items()}
    a.train_batch(random_batch(seed=10 + rank), nll_loss, n_loss_tokens)
    run.save_recover(2, {"actor": a}, {"rank": rank})
    a.destroy()
    if rank == 0:  # rank 1's shard: which rank verifies it is the ranks' business, not the test's
        shard = run.run_dir / "recover" / "ckpt-2" / "actor" / "__1_0.distcp"
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            f.write(b"\x00" * 4096)
    run.barrier()
    b = make_engine(path, mesh=ctx.mesh)
    state = run.load_recover({"actor": b})
    loaded = b.full_state_dict()
    same = all(torch.equal(saved[k], loaded[k]) for k in saved)
    torch.save(
        {"step": state["step"], "rank": state["rank"], "same_as_step1": same},
        Path(out) / f"rank{rank}.pt",
    )
    b.destroy()
    close_distributed()


def test_two_ranks_fall_back_together_when_one_ranks_shard_is_corrupt(tiny_model_dir, tmp_path):
    run_ranks(_two_rank_resume, 2, (tiny_model_dir, free_port(), str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results == [{"step": 1, "rank": r, "same_as_step1": True} for r in range(2)]
