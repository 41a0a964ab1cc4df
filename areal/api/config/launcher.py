"""Cluster and launcher config sections: where the job's processes run (``cluster``) and how the
launcher starts, watches and stops them (``launcher``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from areal.api.config.loader import param


@dataclass(frozen=True)
class NameResolveConfig:
    """Key-value registry shared by the processes of one trial (servers publish addresses)."""

    type: Literal["file", "memory", "etcd", "ray"] = param(
        "file", help="file: a directory every process can see (local disk for one machine, a "
        "shared filesystem such as NFS for several). memory: inside one process only (tests, "
        "single-process runs; a launched job's servers and trainers cannot share it). etcd: an "
        "etcd v3 server (>= 3.4); a dead process's entries vanish after `ttl`. ray: a named actor "
        "in the Ray cluster the processes are connected to."
    )
    file_root: str = param(
        "", help="Root directory of the file registry; empty = FILEROOT/name_resolve. The etcd "
        "and ray registries use this path as their namespace, so runs under different roots "
        "never see each other's keys."
    )
    etcd_address: str = param(
        "127.0.0.1:2379", help="host:port of the etcd client URL (type=etcd); the registry talks "
        "to its JSON gateway at http://host:port/v3/."
    )
    etcd_prefix: str = param(
        "areal", help="Prefix of every etcd key: <etcd_prefix>/<registry root>/<key>."
    )
    ttl: int = param(
        10, ge=2, le=3600, help="Seconds an etcd entry outlives the process that wrote it: the "
        "writer keeps a lease alive (refreshed every ttl/3 s), so a killed server's address is "
        "gone within ttl s. etcd grants at least ~2 s."
    )
    ray_address: str = param(
        "auto", help="Ray cluster to join when the process has not called ray.init (type=ray): "
        "auto = RAY_ADDRESS or the cluster running on this machine, or the GCS host:port."
    )
    timeout: float = param(
        10.0, gt=0, help="Seconds one etcd request or Ray actor call may take before it fails "
        "with an error naming the server."
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
    n_servers: int = param(0, ge=0, help="Generation servers to start (RL runs need >= 1); one "
                           "device each on GPU machines.")
    trainer_nprocs: int = param(
        1, ge=1, help="Trainer ranks per node (data parallel); one device each on GPU machines."
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = param(
        "auto", help="torch.distributed backend of the trainer ranks; auto = nccl on GPU, gloo on CPU."
    )
    name_resolve: NameResolveConfig = param(
        factory=NameResolveConfig, help="Where servers register their addresses for the trainers."
    )

    def check(self) -> Iterator[str]:
        if self.devices_per_node and self.trainer_nprocs + self.n_servers > self.devices_per_node * self.n_nodes:
            yield (
                f"devices_per_node: {self.devices_per_node} x {self.n_nodes} node(s) cannot hold "
                f"{self.trainer_nprocs} trainer ranks + {self.n_servers} servers; lower "
                "cluster.trainer_nprocs or cluster.n_servers"
            )


@dataclass(frozen=True)
class LauncherConfig:
    """How `areal launch` starts, watches and stops the job's processes."""

    server_setup_timeout: float = param(
        180.0, gt=0, help="Seconds each server gets to answer /health and register before the launch fails."
    )
    stop_timeout: float = param(
        20.0, gt=0, help="Seconds processes get after SIGTERM before they are killed."
    )
    server_threads: int = param(
        0, ge=0, help="OMP/torch threads per server process; 0 = torch's default."
    )
    trainer_threads: int = param(
        0, ge=0, help="OMP/torch threads per trainer rank; 0 = torch's default."
    )
    echo: bool = param(True, help="Echo every process's output to the console with a prefix.")
    server_restarts: int = param(
        2, ge=0, help="Times a generation server that dies is restarted (same port, newest "
        "published weights and their version; weight_update_mode=disk only); then the trainer "
        "goes on with the others."
    )
