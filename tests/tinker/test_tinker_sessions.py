"""Ownership, tinker:// paths and futures of the Tinker service (tier 1: no model, no HTTP)."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal.tinker.futures import FutureStore, Reply, SerialWorker
from areal.tinker.sessions import Registry, owner_of
from areal.tinker.trainer import ModelSpec
from areal.tinker.wire import ApiError

ALICE, BOB = owner_of("tml-alice"), owner_of("tml-bob")
SPEC = ModelSpec(base_dir="/models/tiny", rank=4, alpha=32.0, seed=1)


def status(fn) -> tuple[int, str]:
    with pytest.raises(ApiError) as info:
        fn()
    return info.value.status, info.value.message


@pytest.fixture
def registry(tmp_path) -> Registry:
    reg = Registry(tmp_path)
    reg.add_run("s1:train:0", ALICE, "tiny", SPEC, engine=object())  # type: ignore[arg-type]
    return reg


def test_owner_is_a_hash_never_the_key():
    assert owner_of("tml-alice") == owner_of("tml-alice") != owner_of("tml-alice2")
    assert "alice" not in owner_of("tml-alice") and len(owner_of("tml-alice")) == 64


def test_checkpoint_paths_resolve_for_their_owner_only(registry, tmp_path):
    ckpt = registry.checkpoint_dir("s1:train:0", "training", "step3")
    assert ckpt.tinker_path == "tinker://s1:train:0/weights/step3"
    assert ckpt.dir == tmp_path / "s1:train:0" / "weights" / "step3"
    path = ckpt.tinker_path
    assert status(lambda: registry.resolve(path, ALICE)) == (
        404,
        f"path: no checkpoint at {path!r}",
    )
    ckpt.dir.mkdir(parents=True)
    registry.record_checkpoint(ckpt, {"note": "x"})
    assert registry.resolve(path, ALICE).dir == ckpt.dir
    assert status(lambda: registry.resolve(path, BOB)) == (
        403,
        "model_id: 's1:train:0' belongs to another API key",
    )
    listed = registry.list_checkpoints("s1:train:0", ALICE)
    assert [(c["checkpoint_id"], c["tinker_path"], c["user_metadata"]) for c in listed] == [
        ("weights/step3", path, {"note": "x"})
    ]


@pytest.mark.parametrize(
    "path, code, message",
    [
        ("s1:train:0/weights/a", 400, "is not a checkpoint path"),
        ("tinker://s1:train:0/optimizer/a", 400, "is not a checkpoint path"),
        ("tinker://s1:train:0/weights/..", 400, "is not a checkpoint name"),
        ("tinker://nosuch:train:0/weights/a", 404, "is not a training run of this service"),
        ("tinker://..:x/weights/a", 404, "is not a model id of this service"),
    ],
)
def test_bad_paths_are_refused_naming_the_field(registry, path, code, message):
    got, text = status(lambda: registry.resolve(path, ALICE, "model_path"))
    assert got == code and message in text, text
    assert text.startswith(("model_path:", "model_id:", "path:"))


def test_runs_survive_a_new_registry_but_models_do_not(registry, tmp_path):
    again = Registry(tmp_path)
    assert again.run("s1:train:0", ALICE).spec == SPEC
    got, text = status(lambda: again.model("s1:train:0", ALICE))
    assert got == 404 and "create_training_client_from_state" in text
    assert status(lambda: again.add_run("s1:train:0", ALICE, "tiny", SPEC, object()))[0] == 400


def test_futures_answer_their_owner_and_carry_failures():
    store = FutureStore()
    worker = SerialWorker("test-worker")
    rid, entry = store.create(ALICE)
    assert status(lambda: store.get(rid, BOB))[0] == 403
    assert status(lambda: store.get("req-nosuch", ALICE))[0] == 404
    assert asyncio.run(store.wait(entry, 0.05)) is None  # not done: the client tries again
    worker.submit(lambda: Reply(b'{"ok": 1}'), entry)
    assert asyncio.run(store.wait(store.get(rid, ALICE), 5)) == Reply(b'{"ok": 1}')

    def refuse() -> Reply:
        raise ApiError(400, "data[0]: bad")

    def crash() -> Reply:
        raise RuntimeError("boom")

    answers = []
    for fn in (refuse, crash, lambda: Reply(b"{}")):  # a failure fails its request only
        _, e = store.create(ALICE)
        worker.submit(fn, e)
        answers.append(asyncio.run(store.wait(e, 5)))
    worker.stop()
    assert json.loads(answers[0].body) == {"error": "data[0]: bad", "category": "user"}
    assert json.loads(answers[1].body) == {"error": "RuntimeError: boom", "category": "server"}
    assert answers[2] == Reply(b"{}")
