"""Tier 2 (no model, no launch): the replay record's files are written and read safely.

- a step file holds tensors and one JSON string; it reads back the exact batch, version and RNG
  states, through ``torch.load(weights_only=True)``: a pickle of the recorded run (an older
  format, or a crafted file) is refused without running it;
- a damaged ``meta.json``, step file, ``hashes.jsonl`` or weights file is one line naming the
  file and what is wrong;
- ``areal replay`` runs no script unless told which: ``--trust-run-dir`` runs the run dir's
  recorded copy (never the path meta.json names), ``--script PATH`` the user's file.
"""

from __future__ import annotations

import json
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from areal.api.config.base import ReplayConfig
from areal.cli import main as cli_main
from areal.runtime.replay import ReplayRecorder, check_step, load_step
from areal.runtime.replay_files import (
    ReplayFileError,
    ReplayRefused,
    read_meta,
    recorded_hashes,
    replay_script,
)
from areal.runtime.run import rng_state, set_rng_state
from areal.utils.batch import PackedBatch


class FakeActor:
    """What the recorder reads of an actor: a version and one tensor that each step moves."""

    def __init__(self) -> None:
        self.version, self.w = 0, torch.zeros(3)

    def get_version(self) -> int:
        return self.version

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.clone()}


def _batch() -> PackedBatch:
    cu = torch.tensor([0, 3, 5])
    tokens = {"input_ids": torch.arange(5), "loss_mask": torch.tensor([0, 1, 1, 0, 1])}
    return PackedBatch(cu, tokens, {"rewards": torch.tensor([1.0, -0.5])})


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch):
    """RUN_DIR with a 2-step record (keep_weights) and the RNG draws right after each capture,
    as an entry script records it (under pytest-xdist ``__main__`` is no script file)."""
    script = tmp_path / "entry_script.py"
    script.write_text("CONFIG = None\n")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    actor, draws = FakeActor(), []
    rec = ReplayRecorder(ReplayConfig(enabled=True, keep_weights=True), tmp_path, 0, 1)
    try:
        for step in (1, 2):
            with rec.step(step, _batch(), actor):
                draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
                actor.w += step
                actor.version += 1
    finally:
        torch.use_deterministic_algorithms(False)  # the recorder turned it on for this process
    return tmp_path, draws


def test_a_step_file_reads_back_the_exact_batch_version_and_rng_states(recorded):
    run_dir, draws = recorded
    root = run_dir / "replay"
    assert (root / "script.py").is_file() and read_meta(run_dir)["world_size"] == 1
    batch, record = load_step(root, 2)
    want = _batch()
    assert torch.equal(batch.cu_seqlens, want.cu_seqlens)
    assert all(torch.equal(batch[k], want[k]) for k in ("input_ids", "loss_mask", "rewards"))
    assert record["step"] == 2 and record["version"] == 1
    saved = rng_state()
    set_rng_state(record["rng"])  # the states captured just before step 2's draws
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws[1]
    set_rng_state(saved)
    assert sorted(recorded_hashes(root)) == [0, 1, 2]


def test_a_pickled_step_file_is_refused_without_running_it(recorded, tmp_path):
    run_dir, _ = recorded
    marker = tmp_path / "ran"

    class Payload:  # what a crafted (or pre-format-2) pickle can do when unpickled
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = run_dir / "replay" / "step-000001-rank0.pt"
    path.write_bytes(pickle.dumps({"step": 1, "rng": Payload()}, protocol=2))
    with pytest.raises(ReplayFileError, match="not a readable replay step file") as e:
        load_step(run_dir / "replay", 1)
    assert not marker.exists() and str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "not a readable"),
        (lambda p: p.write_bytes(b"\x00garbage" * 10), "not a readable"),
        (lambda p: torch.save({"format": "x", "tensors": {}}, p), "not a areal-replay-step/2"),
        (lambda p: _drop_tensor(p, "seqs.rewards"), r"\['seqs.rewards'\] are missing"),
        (lambda p: _drop_tensor(p, "tokens.input_ids", keep_rows=2), "tokens.input_ids has 2"),
    ],
    ids=["truncated", "garbage", "foreign", "missing-tensor", "short-tensor"],
)
def test_a_damaged_step_file_is_one_line_naming_it(recorded, damage, match):
    run_dir, _ = recorded
    path = run_dir / "replay" / "step-000002-rank0.pt"
    damage(path)
    with pytest.raises(ReplayFileError, match=match) as e:
        load_step(run_dir / "replay", 2)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def _drop_tensor(path: Path, key: str, keep_rows: int | None = None) -> None:
    obj = torch.load(path, weights_only=True)
    if keep_rows is None:
        del obj["tensors"][key]
    else:
        obj["tensors"][key] = obj["tensors"][key][:keep_rows]
    torch.save(obj, path)


def test_a_truncated_or_wrong_meta_json_is_one_line_naming_it(recorded):
    run_dir, _ = recorded
    meta = run_dir / "replay" / "meta.json"
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])
    with pytest.raises(ReplayFileError, match="is not valid JSON") as e:
        read_meta(run_dir)
    assert str(meta) in str(e.value) and "\n" not in str(e.value)
    meta.write_text(json.dumps({"world_size": "1", "torch": "2", "threads": 1}))
    with pytest.raises(ReplayFileError, match="lacks world_size"):
        read_meta(run_dir)


def test_a_run_dir_that_is_not_there_is_named_as_such_not_as_unrecorded(tmp_path):
    with pytest.raises(ReplayFileError, match="no such run directory") as e:
        read_meta(tmp_path / "typo")
    assert "was not recorded" not in str(e.value)
    with pytest.raises(ReplayFileError, match="was not recorded for replay"):
        read_meta(tmp_path)  # a run dir without replay/


def test_damaged_hashes_and_weights_files_are_one_line_naming_them(recorded):
    run_dir, _ = recorded
    root = run_dir / "replay"
    lines = (root / "hashes.jsonl").read_text().splitlines()
    (root / "hashes.jsonl").write_text(lines[0] + "\n" + lines[2] + "\n" + lines[1][:20])
    with pytest.raises(ReplayFileError, match=r"step\(s\) \[1\] are missing"):
        recorded_hashes(root)  # the half-written last line is skipped; the gap is an error
    (root / "weights-000002.pt").write_bytes(b"not a torch file")
    recorded_step2 = json.loads(lines[2])["tensors"]
    with pytest.raises(ReplayFileError, match="weights-000002.pt is unreadable"):
        check_step(root, 2, recorded_step2, {"w": torch.ones(3)})


def test_a_resume_drops_a_half_written_hashes_line(recorded):
    run_dir, _ = recorded
    root = run_dir / "replay"
    with open(root / "hashes.jsonl", "a") as f:
        f.write('{"step": 3, "tens')
    rec = ReplayRecorder(ReplayConfig(enabled=True), run_dir, 0, 1, fresh=False)
    torch.use_deterministic_algorithms(False)
    rec.truncate_after(1)
    assert [json.loads(ln)["step"] for ln in (root / "hashes.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]
    assert not (root / "step-000002-rank0.pt").exists()


def _scripts(run_dir: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """meta.json naming an 'original' script and a recorded copy that differ; each leaves a
    marker file when imported. Returns (original's marker, copy's marker, a --script file)."""
    root = run_dir / "replay"
    original = tmp_path / "original.py"
    body = (
        "from pathlib import Path\nPath({!r}).touch()\nCONFIG = setup_trainers = train_step = 0\n"
    )
    original.write_text(body.format(str(tmp_path / "original-ran")))
    (root / "script.py").write_text(body.format(str(tmp_path / "copy-ran")))
    meta = json.loads((root / "meta.json").read_text())
    meta.update(script=str(original), script_sha256=None)
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "hashes.jsonl").write_text("")  # replay_run then stops at once: nothing recorded
    mine = tmp_path / "mine.py"
    mine.write_text(body.format(str(tmp_path / "mine-ran")))
    return tmp_path / "original-ran", tmp_path / "copy-ran", mine


def test_replay_refuses_to_run_any_script_unless_told_which(recorded, tmp_path):
    run_dir, _ = recorded
    original_ran, copy_ran, _ = _scripts(run_dir, tmp_path)
    with pytest.raises(SystemExit) as e:
        cli_main(["replay", str(run_dir)])
    msg = str(e.value.code)
    assert msg.startswith("areal replay: ") and "\n" not in msg
    assert "--trust-run-dir" in msg and "--script PATH" in msg and str(original_ran.parent) in msg
    assert not original_ran.exists() and not copy_ran.exists()


def test_trust_run_dir_runs_the_recorded_copy_and_script_runs_the_users_file(recorded, tmp_path):
    run_dir, _ = recorded
    original_ran, copy_ran, mine = _scripts(run_dir, tmp_path)
    with pytest.raises(SystemExit, match="records no trained step yet"):
        cli_main(["replay", "--trust-run-dir", str(run_dir)])
    assert copy_ran.exists() and not original_ran.exists()
    with pytest.raises(SystemExit, match="records no trained step yet"):
        cli_main(["replay", "--script", str(mine), str(run_dir)])
    assert (tmp_path / "mine-ran").exists() and not original_ran.exists()


def test_a_recorded_copy_changed_after_the_run_is_refused(recorded):
    run_dir, _ = recorded
    meta = read_meta(run_dir)
    assert replay_script(run_dir, meta, None, trust=True) == run_dir / "replay" / "script.py"
    (run_dir / "replay" / "script.py").write_text("print('changed')\n")
    with pytest.raises(ReplayFileError, match="changed after the run recorded it"):
        replay_script(run_dir, meta, None, trust=True)
    with pytest.raises(ReplayRefused):
        replay_script(run_dir, meta, None, trust=False)


def test_a_script_defining_its_own_config_dataclass_and_importing_a_sibling_replays(
    recorded, tmp_path, monkeypatch
):
    """As under the launcher: a config dataclass the script defines (with postponed
    annotations, which dataclasses resolves through sys.modules) and a module beside it."""
    run_dir, _ = recorded
    _scripts(run_dir, tmp_path)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "my_helpers.py").write_text("LR = 0.5\n")
    (scripts / "own.py").write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "from my_helpers import LR\n"
        "@dataclass\n"
        "class MyConfig:\n"
        "    lr: float = LR\n"
        "CONFIG = MyConfig\n"
        "setup_trainers = train_step = None\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # the replay adds the script's directory
    monkeypatch.delitem(sys.modules, "my_helpers", raising=False)
    try:
        with pytest.raises(SystemExit, match="records no trained step yet"):
            cli_main(["replay", "--script", str(scripts / "own.py"), str(run_dir)])
        assert sys.modules["areal_replayed_script"].CONFIG().lr == 0.5
    finally:
        sys.modules.pop("areal_replayed_script", None)
        sys.modules.pop("my_helpers", None)
