"""Paths and token ids a config names are checked before anything starts; user errors of every
``areal`` command are one message and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal.api.config import GRPOConfig, load_config
from areal.runtime.preflight import model_dir_problem, preflight

BASE = ["actor.use_critic=false", "cluster.n_servers=1"]


def _problems(tmp_path, *overrides: str) -> list[str]:
    return preflight(load_config(GRPOConfig, [f"fileroot={tmp_path}", *BASE, *overrides]))


def test_a_good_config_has_no_problems(tmp_path, tiny_model_dir):
    assert _problems(tmp_path, f"actor.path={tiny_model_dir}") == []


def test_missing_model_dirs_datasets_and_tokenizers_are_named(tmp_path, tiny_model_dir):
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    problems = _problems(
        tmp_path,
        "actor.path=/nonexistent/model",
        f"ref.path={tmp_path / 'no_weights'}",
        "actor.kl_ctl=0.1",
        "train_dataset.path=/nonexistent/train.jsonl",
        f"tokenizer_path={tmp_path}",
    )
    by_field = {p.split(":")[0]: p for p in problems}
    assert sorted(by_field) == ["actor.path", "ref.path", "tokenizer_path", "train_dataset.path"], (
        problems
    )
    assert (
        "'/nonexistent/model' does not exist" in by_field["actor.path"]
        and "hf download" in by_field["actor.path"]
    )
    assert "no *.safetensors" in by_field["ref.path"]
    assert "'/nonexistent/train.jsonl' does not exist" in by_field["train_dataset.path"]
    assert "no tokenizer_config.json" in by_field["tokenizer_path"]


def test_stop_token_ids_outside_the_models_vocabulary_are_refused(tmp_path, tiny_model_dir):
    import json
    from pathlib import Path

    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    problems = _problems(
        tmp_path,
        f"actor.path={tiny_model_dir}",
        f"gconfig.stop_token_ids=[1, {vocab}]",
        "eval_gconfig.stop_token_ids=[-1]",
    )
    assert [p.split(":")[0] for p in problems] == [
        "gconfig.stop_token_ids",
        "eval_gconfig.stop_token_ids",
    ]
    assert f"[{vocab}] outside the model's vocabulary [0, {vocab})" in problems[0]


def test_a_model_family_the_embedded_servers_do_not_serve_is_refused_before_launch(
    tmp_path, tiny_model_dir
):
    import json
    import shutil
    from pathlib import Path

    unserved = tmp_path / "unserved"
    shutil.copytree(tiny_model_dir, unserved)
    config = json.loads((unserved / "config.json").read_text())
    (unserved / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    problems = _problems(tmp_path, f"actor.path={unserved}")
    assert len(problems) == 1 and problems[0].startswith(f"actor.path: {str(unserved)!r}: "), (
        problems
    )
    assert "model_type 'gpt2'" in problems[0] and "qwen2, qwen3, llama, qwen3_moe" in problems[0]
    assert "rollout.backend=vllm|sglang" in problems[0]
    # another backend serves it: no problem here (vLLM/SGLang check their own models)
    vllm = ["rollout.backend=vllm", "rollout.served_model_name=m"]
    assert _problems(tmp_path, f"actor.path={unserved}", *vllm) == []
    assert _problems(tmp_path, f"actor.path={Path(tiny_model_dir)}") == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--model", "/nonexistent"], "model_path: '/nonexistent' does not exist"),
        (["plot", "/nonexistent"], "/nonexistent: no such run directory"),
        (["tiny-model", "--out", "/proc/no/such"], "No such file or directory"),
        (["launch", "local", "/nonexistent.py"], "launch script /nonexistent.py does not exist"),
    ],
)
def test_user_errors_of_every_command_are_one_message_and_exit_2(argv, message):
    out = subprocess.run(
        [sys.executable, "-m", "areal.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"areal {argv[0]}: ")


def test_script_file_override_and_config_mistakes_are_one_message_naming_the_fix(tmp_path):
    """Each used to be a traceback (no CONFIG, --out a file) or a misleading message ("- : unknown
    key" for "=5", "no such file" for a directory)."""
    script, a_file = tmp_path / "no_config.py", tmp_path / "a_file"
    script.write_text("x = 1\n")
    a_file.write_text("")
    grpo = "examples/gsm8k_grpo.py"
    cases = [
        (
            ["launch", "local", str(script), "--config", "examples/arithmetic_grpo.yaml"],
            "defines no CONFIG; add `CONFIG = GRPOConfig`",
        ),
        (
            ["tiny-model", "--out", str(a_file)],
            f"--out {a_file}: is a file, not a directory; pass a new",
        ),
        (
            ["launch", "local", grpo, "=5"],
            "override '=5': empty key or key part before '='; write key=value",
        ),
        (
            ["launch", "local", grpo, "--config", str(tmp_path)],
            f"--config {tmp_path}: is a directory; pass a YAML",
        ),
    ]
    for argv, message in cases:
        out = subprocess.run(
            [sys.executable, "-m", "areal.cli", *argv], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 2 and out.stderr.startswith(f"areal {argv[0]}: "), (
            argv,
            out.stderr,
        )
        assert message in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
        assert "unknown key" not in out.stderr and "no such file" not in out.stderr, (
            argv,
            out.stderr,
        )


def test_a_missing_run_export_says_to_run_its_stage_not_to_download(tmp_path):
    """A path under no example's experiment: the demo's SFT export is the model to start from;
    the cause is the missing run, not the hub (issue 34)."""
    problems = _problems(tmp_path, "actor.path=runs/mine/trial0/checkpoints/model/step300")
    (actor,) = [p for p in problems if p.startswith("actor.path")]
    assert (
        "training run's export" in actor
        and "runs/quickstart/sft/run/checkpoints/model/step300" in actor
    )
    assert "hf download" not in actor


def test_a_missing_export_of_an_examples_run_names_that_example_not_the_demo(tmp_path):
    # examples/agent_arithmetic.yaml starts from examples/agent_arithmetic_sft.yaml's export: the
    # addition demo's SFT model would starve its GRPO (issue 57)
    problem = model_dir_problem(
        "actor.path", "runs/sft-agent-arithmetic/trial0/checkpoints/model/step400"
    )
    assert "written by the run of examples/agent_arithmetic_sft.yaml: run that first" in problem
    assert "quickstart" not in problem and "hf download" not in problem


def test_a_missing_teacher_export_points_at_the_demos_grpo_model_not_its_sft_model(tmp_path):
    # a teacher must be stronger than the student: the SFT model is where the student starts
    problem = model_dir_problem("distill.teacher_path", "runs/x/trial0/checkpoints/actor/step150")
    assert "runs/quickstart/grpo/run/checkpoints/actor/step150" in problem
    assert "sft" not in problem
