"""Tier 1: the launch env contract's helpers."""

from areal.api.launch import (
    COLOCATED,
    RAY_AUTH_MODE,
    LaunchEnv,
    disable_ray_token_auth,
    trainer_env,
)


def test_ray_token_auth_is_turned_off_unless_the_user_opted_in():
    env: dict[str, str] = {}
    disable_ray_token_auth(env)
    assert env == {
        RAY_AUTH_MODE: "disabled"
    }  # else Ray 2.60 writes ~/.ray/auth_token for the machine
    opted_in = {RAY_AUTH_MODE: "token"}
    disable_ray_token_auth(opted_in)
    assert opted_in == {RAY_AUTH_MODE: "token"}


def test_a_colocated_trainer_learns_it_from_its_env():
    assert LaunchEnv.read(trainer_env(0, colocated=True)).colocated
    assert COLOCATED not in trainer_env(0) and not LaunchEnv.read(trainer_env(0)).colocated
