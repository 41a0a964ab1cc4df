"""The launch plan: the process roles a run needs, as data every launcher places.

:func:`launch_plan` reads the config, and only the config, into a :class:`LaunchPlan`: one
:class:`Role` per generation server (``cluster.n_servers``), per distillation teacher server
(``distill.n_servers``), the agent proxy (``workflow.type: agent_cmd``) and the trainer (its
``cluster.n_nodes x cluster.trainer_nprocs`` ranks), each with what it needs (processes,
accelerators, threads, the node it goes on), where it registers ``host:port`` once it serves,
how often a launcher restarts it, what it waits for and whether its exit ends the attempt. The
launchers (``local``, ``ray``, ``slurm``) iterate the roles and decide only how to place them on
their machines; a role a launcher cannot place is refused before anything starts
(:func:`refusals`; each launcher names what it places in its ``PLACES``). Reward workers are
not roles: the trainer ranks start them as processes of their own (``reward.n_workers``).

Start order: a role's ``after`` names the kinds whose registration it waits for; every role
also waits for them itself in the trial registry, so a launcher may start it beside them (the
local launcher does, to overlap their start-ups) or after them (Ray).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config import BaseExperimentConfig
from areal.utils.name_resolve import agent_proxy_key, gen_servers_key, gen_teacher_key

RoleKind = Literal["server", "teacher", "agent_proxy", "trainer"]
SERVING: tuple[RoleKind, ...] = ("server", "teacher")  # roles that run a generation server


@dataclass(frozen=True)
class Role:
    """One process role of a run (see the module docstring)."""

    name: str  # the process's name: its log is RUN_DIR/logs/<name>.log
    kind: RoleKind
    setting: str  # the config setting that asks for it, as the user would write it
    processes: int = 1  # the trainer: its ranks in all
    # index of its node in the job; None: every node (the trainer). Slurm places by it; Ray
    # leaves the nodes to launcher.ray.placement_strategy; local has one node
    node: int | None = 0
    accelerator: bool = True  # one accelerator per process where the machines have them
    colocated: bool = False  # a server on a trainer rank's accelerator (cluster.colocate: true)
    threads: int = 0  # OpenMP/torch threads per process; 0 = the launcher's share
    model: str = ""  # the HF dir a serving role loads
    registry_key: str = ""  # where it publishes host:port once it serves ('' = it does not)
    restarts: int = 0  # times a launcher restarts it after it dies
    no_restart_reason: str = ""  # why it is not restarted ('' when restarts > 0)
    after: tuple[RoleKind, ...] = ()  # the kinds whose registration it waits for
    shares_token: bool = False  # gets the attempt's agent proxy control token by env
    ends_run: bool = False  # its exit ends the attempt (else the run goes on without it)

    @property
    def task_log(self) -> str:
        """The log name of the role's own process: a serving role's task (``server_task``)
        logs to ``<name>-task``, its server to ``<name>``; any other role to ``<name>``."""
        return f"{self.name}-task" if self.kind in SERVING else self.name

    @property
    def placement(self) -> str:
        """What a launcher must be able to place for it: its kind, or a colocated server."""
        return "colocated server" if self.colocated else self.kind


@dataclass(frozen=True)
class LaunchPlan:
    """The roles of one run, in start order (servers, teachers, agent proxy, trainer)."""

    roles: tuple[Role, ...]

    def of(self, *kinds: RoleKind) -> list[Role]:
        """The roles of these kinds, in plan order."""
        return [r for r in self.roles if r.kind in kinds]

    def role(self, name: str) -> Role:
        """The role named ``name``; ValueError naming the roles there are."""
        for r in self.roles:
            if r.name == name:
                return r
        names = ", ".join(r.name for r in self.roles)
        raise ValueError(f"no role {name!r} in this run's launch plan; it has {names}")

    @property
    def trainer(self) -> Role:
        """The trainer role (every plan has one)."""
        return self.of("trainer")[0]

    @property
    def tasks(self) -> list[Role]:
        """Every role but the trainer: each runs as one process of its own (a task)."""
        return [r for r in self.roles if r.kind != "trainer"]

    @property
    def serving(self) -> list[Role]:
        """The roles that run a generation server (the student's, then the teacher's)."""
        return self.of(*SERVING)


def launch_plan(cfg: BaseExperimentConfig) -> LaunchPlan:
    """The launch plan of ``cfg`` (pure: it reads the config only)."""
    c = cfg.cluster
    servers = list(_serving_roles(cfg))
    roles = servers + list(_agent_proxy_role(cfg))
    trainer = Role(
        "trainer",
        "trainer",
        f"cluster.n_nodes={c.n_nodes} x cluster.trainer_nprocs={c.trainer_nprocs}",
        processes=c.n_nodes * c.trainer_nprocs,
        node=None,
        threads=cfg.launcher.trainer_threads,
        after=tuple(dict.fromkeys(r.kind for r in roles)),
        shares_token=any(r.kind == "agent_proxy" for r in roles),
        ends_run=True,
    )
    return LaunchPlan((*roles, trainer))


def _serving_roles(cfg: BaseExperimentConfig) -> Iterator[Role]:
    """Generation server i, then teacher server j, going round the nodes in that order."""
    c, lc = cfg.cluster, cfg.launcher
    names = (cfg.experiment_name, cfg.trial_name)
    blocker = _restart_blocker(cfg)
    restarts = 0 if blocker else lc.server_restarts
    why = blocker or ("launcher.server_restarts=0" if not restarts else "")
    for i in range(c.n_servers):
        yield Role(
            f"server{i}", "server", f"cluster.n_servers={c.n_servers}", node=i % c.n_nodes,
            colocated=c.colocate is True, threads=lc.server_threads, model=cfg.served_model_path,
            registry_key=gen_servers_key(*names), restarts=restarts, no_restart_reason=why,
        )  # fmt: skip
    distill = getattr(cfg, "distill", None)  # only RL experiments distil
    if distill is None or not distill.enabled:
        return
    for j in range(distill.n_servers):
        yield Role(
            f"teacher{j}", "teacher", f"distill.n_servers={distill.n_servers}",
            node=(c.n_servers + j) % c.n_nodes, threads=lc.server_threads,
            model=distill.teacher_path, registry_key=gen_teacher_key(*names),
            no_restart_reason="distillation teacher servers are not restarted",
        )  # fmt: skip


def _restart_blocker(cfg: BaseExperimentConfig) -> str:
    """Why a generation server that dies is not restarted ('' when it may be)."""
    blocker = getattr(cfg, "server_restart_blocker", None)  # experiments with servers have it
    return blocker() if blocker is not None else "this experiment has no generation servers"


def _agent_proxy_role(cfg: BaseExperimentConfig) -> Iterator[Role]:
    """The agent proxy, with ``workflow.type: agent_cmd``: CPU only, on the first node."""
    workflow = getattr(cfg, "workflow", None)  # experiments without rollouts (SFT) have none
    if workflow is None or workflow.type != "agent_cmd":
        return
    yield Role(
        "agent_proxy", "agent_proxy", "workflow.type=agent_cmd", accelerator=False, threads=1,
        registry_key=agent_proxy_key(cfg.experiment_name, cfg.trial_name), after=("server",),
        no_restart_reason="the agent proxy holds its sessions' state", shares_token=True,
        ends_run=True,
    )  # fmt: skip


def refusals(plan: LaunchPlan, launcher: str, places: frozenset[str]) -> list[str]:
    """One line for each placement of ``plan``'s roles (:attr:`Role.placement`) that is not in
    ``places``, what ``launcher`` can place, naming the first such role, the setting that asks
    for it and the fix; empty when it places them all."""
    lines, seen = [], set()
    for r in plan.roles:
        need = r.placement
        if need in places or need in seen:
            continue
        seen.add(need)
        setting = "cluster.colocate=true" if r.colocated else r.setting
        fix = _FIXES.get(
            need, f"use a launcher that places it (docs/launchers.md), or drop {setting}"
        )
        lines.append(
            f"{r.name} ({setting}): `areal launch {launcher}` cannot place a {need}; {fix}"
        )
    return lines


_FIXES = {
    "colocated server": "only `areal launch local` puts servers on the trainers' GPUs; use it on "
    "one machine, or cluster.colocate=null to give each server a GPU of its own",
}
