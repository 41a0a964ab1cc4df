"""Tier 1: an sbatch refusal that never reached placement names the real cause, not the
request's size (issue 34, item 8). The messages are sbatch's own (slurm-wlm 22.05)."""

from __future__ import annotations

from areal.launcher.slurm_errors import controller_problem


def test_no_slurm_configuration_names_the_login_node_and_slurm_conf():
    problem = controller_problem("sbatch: fatal: Could not establish a configuration source")
    assert (
        "no Slurm configuration" in problem
        and "SLURM_CONF" in problem
        and "Ask for less" not in problem
    )
    missing = (
        "sbatch: error: s_p_parse_file: cannot stat file /etc/slurm/slurm.conf: No such file or "
        "directory; sbatch: fatal: Unable to process configuration file"
    )
    assert "no Slurm configuration" in controller_problem(missing)


def test_an_unreachable_controller_says_check_slurmctld():
    problem = controller_problem(
        "sbatch: error: Batch job submission failed: Unable to contact slurm controller "
        "(connect failure)"
    )
    assert "slurmctld did not answer" in problem and "scontrol ping" in problem
    assert "no answer in time" in controller_problem("", timed_out=True)


def test_munge_failures_name_the_credentials():
    assert "munge" in controller_problem("sbatch: error: Invalid authentication credential")


def test_a_placement_refusal_is_left_to_the_request_check():
    assert (
        controller_problem(
            "sbatch: error: Batch job submission failed: Requested node configuration is "
            "not available"
        )
        == ""
    )
