"""Tier 1: the launch plan (areal.launcher.plan) read from configs by hand, and the refusal of a
role a launcher cannot place, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.api.config import GRPOConfig, SFTConfig, load_config
from areal.launcher import local, ray, slurm
from areal.launcher.common import launch
from areal.launcher.plan import launch_plan, refusals

BASE = ["actor.path=/models/m", "actor.use_critic=false", "experiment_name=e", "trial_name=t"]
ALL_ROLES = [
    *BASE,
    "cluster.n_nodes=2",
    "cluster.trainer_nprocs=2",
    "cluster.n_servers=2",
    "distill.teacher_path=/models/teacher",
    "distill.n_servers=1",
    "workflow.type=agent_cmd",
    "workflow.agent.command=python agent.py",
]


def test_every_role_of_a_distilling_agent_run_is_in_the_plan_in_start_order():
    plan = launch_plan(load_config(GRPOConfig, ALL_ROLES))
    assert [r.name for r in plan.roles] == [
        "server0", "server1", "teacher0", "agent_proxy", "trainer",
    ]  # fmt: skip
    # serving roles go round the 2 nodes in plan order: server0 -> 0, server1 -> 1,
    # teacher0 (the third) -> 2 mod 2 = 0; the agent proxy on the first node; the trainer on all
    assert [r.node for r in plan.roles] == [0, 1, 0, 0, None]
    trainer = plan.trainer
    assert trainer.processes == 4  # 2 nodes x 2 ranks
    assert trainer.after == ("server", "teacher", "agent_proxy") and trainer.ends_run
    assert [r.name for r in plan.tasks] == ["server0", "server1", "teacher0", "agent_proxy"]


def test_serving_roles_register_under_their_own_keys_and_only_servers_restart():
    plan = launch_plan(load_config(GRPOConfig, ALL_ROLES))
    server, teacher = plan.role("server0"), plan.role("teacher0")
    assert (server.model, teacher.model) == ("/models/m", "/models/teacher")
    assert server.registry_key.endswith("e/t/gen_servers")
    assert teacher.registry_key.endswith("e/t/teacher_servers")
    assert (server.restarts, server.no_restart_reason) == (2, "")  # launcher.server_restarts
    assert teacher.restarts == 0 and "not restarted" in teacher.no_restart_reason
    assert server.setting == "cluster.n_servers=2" and teacher.setting == "distill.n_servers=1"
    assert not server.ends_run and not teacher.ends_run  # the run goes on without a lost one


def test_the_agent_proxy_is_cpu_only_waits_for_the_servers_and_shares_its_token():
    plan = launch_plan(load_config(GRPOConfig, ALL_ROLES))
    proxy = plan.role("agent_proxy")
    assert not proxy.accelerator and proxy.threads == 1 and proxy.after == ("server",)
    assert proxy.registry_key.endswith("e/t/agent_proxy") and proxy.ends_run
    assert [r.name for r in plan.roles if r.shares_token] == ["agent_proxy", "trainer"]


def test_a_plain_grpo_run_has_servers_and_the_trainer_only():
    plan = launch_plan(load_config(GRPOConfig, [*BASE, "cluster.n_servers=1"]))
    assert [r.name for r in plan.roles] == ["server0", "trainer"]
    assert plan.trainer.after == ("server",) and not plan.trainer.shares_token


def test_an_sft_run_is_the_trainer_alone_waiting_for_nothing():
    plan = launch_plan(load_config(SFTConfig, ["model.path=/models/m", "train_dataset.type=sft"]))
    assert [r.name for r in plan.roles] == ["trainer"]
    assert plan.trainer.after == () and plan.serving == []


def test_teachers_at_given_addresses_are_not_roles():
    cfg = load_config(
        GRPOConfig,
        [*BASE, "cluster.n_servers=1", "distill.teacher_path=/models/teacher",
         "distill.n_servers=0", "distill.addresses=[10.0.0.1:30000]"],
    )  # fmt: skip
    assert [r.name for r in launch_plan(cfg).roles] == ["server0", "trainer"]


def test_a_server_the_config_cannot_restart_says_why():
    cfg = load_config(GRPOConfig, [*BASE, "cluster.n_servers=1", "weight_update_mode=distributed"])
    server = launch_plan(cfg).role("server0")
    assert server.restarts == 0 and "weight_update_mode=distributed" in server.no_restart_reason
    cfg = load_config(GRPOConfig, [*BASE, "cluster.n_servers=1", "launcher.server_restarts=0"])
    assert launch_plan(cfg).role("server0").no_restart_reason == "launcher.server_restarts=0"


def test_an_unknown_role_name_is_refused_naming_the_roles_there_are():
    plan = launch_plan(load_config(GRPOConfig, [*BASE, "cluster.n_servers=1"]))
    with pytest.raises(ValueError, match="no role 'teacher0'.*it has server0, trainer"):
        plan.role("teacher0")


def test_every_launcher_places_every_role_of_the_plan():
    plan = launch_plan(load_config(GRPOConfig, ALL_ROLES))
    for launcher in (local, ray, slurm):
        assert refusals(plan, launcher.__name__, launcher.PLACES) == []


def test_a_role_a_launcher_cannot_place_is_refused_in_one_line_with_setting_and_fix():
    plan = launch_plan(load_config(GRPOConfig, ALL_ROLES))
    [line] = refusals(plan, "x", frozenset({"server", "agent_proxy", "trainer"}))
    assert line.startswith(
        "teacher0 (distill.n_servers=1): `areal launch x` cannot place a teacher"
    )
    assert "or drop distill.n_servers=1" in line
    # colocated servers: one line for all of them, naming the setting and the fix
    colocated = launch_plan(
        load_config(GRPOConfig, [*BASE, "cluster.n_servers=2", "cluster.colocate=true"])
    )
    [line] = refusals(colocated, "ray", ray.PLACES)
    assert line.startswith("server0 (cluster.colocate=true): `areal launch ray` cannot place")
    assert "cluster.colocate=null" in line
    assert refusals(colocated, "local", local.PLACES) == []


def test_the_launch_refuses_an_unplaceable_role_before_anything_starts(
    capsys, tmp_path, tiny_model_dir
):
    started = []
    script = Path(__file__).parent / "entry_script.py"  # only its CONFIG is read
    argv = [f"actor.path={tiny_model_dir}", "actor.use_critic=false", f"fileroot={tmp_path}",
            "cluster.n_servers=1", "cluster.colocate=true"]  # fmt: skip
    code = launch(str(script), argv, lambda cfg, attempt: started.append(attempt) or 0, "slurm",
                  slurm.PLACES)  # fmt: skip
    assert code == 2 and started == []
    err = capsys.readouterr().err
    assert "server0 (cluster.colocate=true): `areal launch slurm` cannot place" in err, err
    assert not (tmp_path / "areal").exists()  # nothing written: no config.yaml, no logs
