"""What an ``sbatch`` refusal means when it is not about the request's size.

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
        "this machine has no Slurm configuration (no slurm.conf, no SLURM_CONF, no DNS SRV record for the "
        "controller); run `areal launch slurm` on a login node of the cluster, or point SLURM_CONF at its "
        "slurm.conf",
    ),
    (
        r"(?i)unable to contact|timed out|connection refused|slurm_persist_conn|zero bytes were transmitted",
        "slurmctld did not answer; check that the controller is up (`scontrol ping`) and reachable from this "
        "machine (SlurmctldHost and SlurmctldPort of slurm.conf), then launch again",
    ),
    (
        r"(?i)munge|authentication|credential",
        "Slurm refused this machine's credentials (munge); check that munged runs here with the cluster's "
        "key (`munge -n | unmunge`)",
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
