"""Cluster and launcher config sections: where the job's processes run (``cluster``) and how the
launcher starts, watches and stops them (``launcher``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param


@dataclass(frozen=True)
class NameResolveConfig:
    """Key-value registry shared by the processes of one trial (servers publish addresses)."""

    type: Literal["file", "memory", "etcd", "ray"] = param(
        "file",
        help="file: a directory every process can see (local disk for one machine, a "
        "shared filesystem such as NFS for several). memory: inside one process only (tests, "
        "single-process runs; a launched job's servers and trainers cannot share it). etcd: an "
        "etcd v3 server (>= 3.4); a dead process's entries vanish after `ttl`. ray: a named actor "
        "in the Ray cluster the processes are connected to.",
    )
    file_root: str = param(
        "",
        help="Root directory of the file registry; empty = FILEROOT/name_resolve. The etcd "
        "and ray registries use this path as their namespace, so runs under different roots "
        "never see each other's keys.",
    )
    etcd_address: str = param(
        "127.0.0.1:2379",
        help="host:port of the etcd client URL (type=etcd); the registry talks "
        "to its JSON gateway at http://host:port/v3/.",
    )
    etcd_prefix: str = param(
        "areal", help="Prefix of every etcd key: <etcd_prefix>/<registry root>/<key>."
    )
    ttl: int = param(
        10,
        ge=2,
        le=3600,
        help="Seconds an etcd entry outlives the process that wrote it: the "
        "writer keeps a lease alive (refreshed every ttl/3 s), so a killed server's address is "
        "gone within ttl s. etcd grants at least ~2 s.",
    )
    ray_address: str = param(
        "auto",
        help="Ray cluster to join when the process has not called ray.init (type=ray): "
        "auto = RAY_ADDRESS or the cluster running on this machine, or the GCS host:port.",
    )
    timeout: float = param(
        10.0,
        gt=0,
        help="Seconds one etcd request or Ray actor call may take before it fails "
        "with an error naming the server.",
    )

    def check(self) -> Iterator[str]:
        host, _, port = self.etcd_address.rpartition(":")
        if self.type == "etcd" and not (host and port.isdigit() and 0 < int(port) < 65536):
            yield (
                f"etcd_address must be host:port with a port in 1..65535, got "
                f"{self.etcd_address!r}; e.g. 127.0.0.1:2379"
            )


@dataclass(frozen=True)
class ClusterConfig:
    """The machines of one job and how their devices split between servers and trainers."""

    n_nodes: int = param(1, ge=1, help="Machines of the job (`areal launch local`: 1).")
    devices_per_node: int | None = param(
        None, ge=0, help="Accelerators per machine; null = what the launch machine has (0 on CPU)."
    )
    n_servers: int = param(
        0,
        ge=0,
        help="Generation servers to start (RL runs need >= 1); one device each on GPU machines.",
    )
    trainer_nprocs: int = param(
        1, ge=1, help="Trainer ranks per node (data parallel); one device each on GPU machines."
    )
    colocate: bool | None = param(
        None,
        help="Generation servers share the trainer ranks' GPUs (server i on the GPU of trainer "
        "rank i mod trainer_nprocs; the server gives back its KV cache while the trainer steps, "
        "see server.gpu_memory_fraction); null = colocate only when the GPUs the launch may use "
        "are fewer than trainer ranks + servers (said in one log line); false = one GPU each. "
        "No effect on CPU machines.",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = param(
        "auto",
        help="torch.distributed backend of the trainer ranks; auto = nccl on GPU, gloo on CPU.",
    )
    name_resolve: NameResolveConfig = param(
        factory=NameResolveConfig, help="Where servers register their addresses for the trainers."
    )

    def check(self) -> Iterator[str]:
        have = (self.devices_per_node or 0) * self.n_nodes
        if not self.devices_per_node:
            return
        if self.colocate is False and self.trainer_nprocs + self.n_servers > have:
            yield (
                f"devices_per_node: {self.devices_per_node} x {self.n_nodes} node(s) cannot "
                f"hold {self.trainer_nprocs} trainer ranks + {self.n_servers} servers one GPU "
                "each; lower cluster.trainer_nprocs or cluster.n_servers, or set "
                "cluster.colocate=true"
            )
        elif self.trainer_nprocs > have:
            yield (
                f"devices_per_node: {self.devices_per_node} x {self.n_nodes} node(s) cannot hold "
                f"{self.trainer_nprocs} trainer ranks (one GPU each, servers colocated); lower "
                "cluster.trainer_nprocs"
            )


@dataclass(frozen=True)
class RayConfig:
    """`areal launch ray`: the Ray cluster and how the job's processes are placed on it."""

    address: str = param(
        "",
        help="Ray cluster to attach to (host:port of the head's GCS, or ray://...); empty = "
        "Ray's own lookup: $RAY_ADDRESS, else the newest `ray start` cluster of this machine, "
        "else a new local instance (stopped with the run).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = param(
        "PACK", help="Ray placement-group strategy for the bundles of servers and trainer ranks."
    )
    placement_timeout: float = param(
        60.0,
        gt=0,
        help="Seconds the placement group may take to be placed; then the launch stops "
        "naming wanted vs available resources.",
    )
    cpus_per_process: float = param(
        1.0, gt=0, help="CPUs each server and each trainer rank reserves in its bundle."
    )
    forward_env: list[str] = param(
        [
            "HF_*",
            "TRANSFORMERS_*",
            "NCCL_*",
            "GLOO_*",
            "TORCH_*",
            "TOKENIZERS_PARALLELISM",
            "PYTHONPATH",
        ],
        help="Environment variables of the launching shell passed on to every process (shell "
        "patterns); Ray workers otherwise see the environment of the node's raylet.",
    )


_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE")


@dataclass(frozen=True)
class SlurmConfig:
    """`areal launch slurm`: what the one batch job asks Slurm for, and how long each wait may
    take (docs/launchers.md)."""

    partition: str = param(
        "", help="Partition (sbatch --partition); empty = the cluster's default one."
    )
    account: str = param(
        "", help="Account charged (sbatch --account); empty = your default account."
    )
    time_limit: str = param(
        "",
        help="Job time limit in Slurm's format (minutes, H:MM:SS, D-HH:MM:SS, ...; sbatch "
        "--time); empty = the partition's default.",
    )
    cpus_per_process: int = param(
        1,
        ge=1,
        help="CPUs for each server and each trainer rank (a node asks for this times the "
        "processes it holds).",
    )
    python: str = param(
        "",
        help="Python interpreter on the nodes (inside the container when one is set); empty = "
        "the launcher's own, which must then be on a filesystem every node sees.",
    )
    container_image: str = param(
        "",
        help="Image every step runs in (srun --container-image, the pyxis plugin); empty = the "
        "nodes' own environment.",
    )
    container_mounts: list[str] = param(
        [],
        help="SRC:DST[:FLAGS] bind mounts for the container (srun --container-mounts); the "
        "repository, RUN_DIR and the name registry must be visible inside at the same paths.",
    )
    sbatch_lines: list[str] = param(
        [],
        help="Extra sbatch options written as '#SBATCH <option>' lines after the generated "
        "ones, e.g. '--qos=high' or '--exclusive'.",
    )
    start_timeout: float = param(
        600.0,
        gt=0,
        help="Seconds the job may pend before it is cancelled (its last pending "
        "reason named); a request Slurm can never place stops at once.",
    )
    cancel_timeout: float = param(
        120.0,
        gt=0,
        help="Seconds a cancelled or finished job gets to leave the queue (Slurm's "
        "KillWait and cleanup) before the launcher gives up, naming the job to scancel.",
    )

    def check(self) -> Iterator[str]:
        if self.time_limit and not _SLURM_TIME.fullmatch(self.time_limit):
            yield (
                f"time_limit: {self.time_limit!r} is not a Slurm time; use minutes (90), H:MM:SS "
                "(1:30:00) or D-HH:MM:SS (2-00:00:00), or empty for the partition's default"
            )
        for line in self.sbatch_lines:
            if not line.startswith("-"):
                yield (
                    f"sbatch_lines: {line!r} is not an sbatch option; write the "
                    "option alone, e.g. '--qos=high' (the '#SBATCH ' prefix is added)"
                )
        if self.container_mounts and not self.container_image:
            yield (
                f"container_mounts: {self.container_mounts} without a "
                "container_image; set launcher.slurm.container_image or drop the mounts"
            )


@dataclass(frozen=True)
class LauncherConfig:
    """How `areal launch` starts, watches and stops the job's processes."""

    server_setup_timeout: float = param(
        180.0,
        gt=0,
        help="Seconds each server gets to answer /health and register before the launch fails.",
    )
    stop_timeout: float = param(
        20.0, gt=0, help="Seconds processes get after SIGTERM before they are killed."
    )
    server_threads: int = param(
        0,
        ge=0,
        help="OMP/torch threads per server process; 0 = chosen from the cores the launch "
        "may use (local: an even share of this process's usable cores among the servers and "
        "trainer ranks; Ray: launcher.ray.cpus_per_process; Slurm: torch's default within the "
        "task's CPUs), logged at start.",
    )
    trainer_threads: int = param(
        0,
        ge=0,
        help="OMP/torch threads per trainer rank; 0 = chosen as for server_threads, logged.",
    )
    echo: bool = param(True, help="Echo every process's output to the console with a prefix.")
    server_restarts: int = param(
        2,
        ge=0,
        help="Times a generation server that dies is restarted (same port, newest "
        "published weights and their version; weight_update_mode=disk only); then the trainer "
        "goes on with the others.",
    )
    slurm: SlurmConfig = param(factory=SlurmConfig, help="`areal launch slurm` only.")
    ray: RayConfig = param(factory=RayConfig, help="`areal launch ray` only.")
