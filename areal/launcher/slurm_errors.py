"""What Slurm's answers mean, each with the fix: an ``sbatch`` refusal that is not about the
request's size, a pending reason that says a job can never start, and the end state of a job
that ended before its trainer did.

``sbatch`` fails before any placement question when it cannot find or reach the cluster's
controller: no Slurm configuration on this machine (``Could not establish a configuration
source``: no ``slurm.conf``, no ``SLURM_CONF``, no DNS SRV record), a controller that is down or
unreachable, or a broken munge authentication. Advice to ask for fewer nodes would point the wrong
way; :func:`controller_problem` names the real cause and its fix.
"""

from __future__ import annotations

import re

_CAUSES = (
    (
        r"(?i)could not establish a configuration source|slurm\.conf.*(no such file|not found)|"
        r"unable to (open|read|process) (configuration|config) file",
        "this machine has no Slurm configuration (no slurm.conf, no SLURM_CONF, no DNS SRV record "
        "for the controller); run `areal launch slurm` on a login node of the cluster, or point "
        "SLURM_CONF at its slurm.conf",
    ),
    (
        r"(?i)unable to contact|timed out|connection refused|slurm_persist_conn|"
        r"zero bytes were transmitted",
        "slurmctld did not answer; check that the controller is up (`scontrol ping`) and "
        "reachable from this machine (SlurmctldHost and SlurmctldPort of slurm.conf), then launch "
        "again",
    ),
    (
        r"(?i)munge|authentication|credential",
        "Slurm refused this machine's credentials (munge); check that munged runs here with the "
        "cluster's key (`munge -n | unmunge`)",
    ),
)


def controller_problem(error: str, timed_out: bool = False) -> str:
    """Why ``sbatch`` (stderr ``error``) never reached a placement decision, with the fix; ''
    when the error is about the request itself."""
    if timed_out:
        return (
            f"sbatch could not reach slurmctld (no answer in time): {error or 'no output'}; "
            + _CAUSES[1][1]
        )
    for pattern, cause in _CAUSES:
        if re.search(pattern, error):
            return f"sbatch failed before placing anything: {error}. Cause: {cause}"
    return ""


# Pending reasons of a request Slurm will never start as it stands (slurm.schedmd.com
# job_reason_codes). ReqNodeNotAvail is not one: Slurm also shows it for a while during backfill
# and for nodes that come back; such a job waits out start_timeout like Resources or Priority.
NEVER_PLACED = {
    "PartitionConfig": "the request is more than the partition's nodes have: CPUs, GPUs or memory",
    "PartitionNodeLimit": "more nodes than the partition allows or has up",
    "PartitionTimeLimit": "the time limit is above the partition's MaxTime",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "BadConstraints": "no node has what the job asks for",
    "InvalidAccount": "the account does not exist or you are not in it",
    "InvalidQOS": "the QOS does not exist or you may not use it",
    "AccountNotAllowed": "the partition does not accept this account",
    "DependencyNeverSatisfied": "a dependency can never be met",
    "JobHeldAdmin": "an administrator holds the job",
    "JobHeldUser": "the job is held (scontrol release JOBID)",
}
NEVER_PLACED_PREFIXES = ("AssocMax", "QOSMax")  # a per-job limit of the association or QOS


def never_placed(reason: str) -> str:
    """What a pending reason means when it says the job can never start as asked ('' when it
    may still start: Resources, Priority, ReqNodeNotAvail, ...)."""
    if reason.startswith(NEVER_PLACED_PREFIXES):
        return "the request is above a per-job limit of your association or QOS"
    return NEVER_PLACED.get(reason, "")


ENDED_WHY = {
    "CANCELLED": "was cancelled (scancel by a user or an administrator, or preemption)",
    "TIMEOUT": "reached its time limit (launcher.slurm.time_limit, or the partition's)",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "PREEMPTED": "was preempted",
    "BOOT_FAIL": "could not boot its nodes",
    "OUT_OF_MEMORY": "ran out of memory",
    "DEADLINE": "passed its deadline",
    "GONE": "is unknown to Slurm",
}
