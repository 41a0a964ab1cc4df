"""Who owns what: API keys, their sessions, training models, sampling sessions and checkpoints.

An API key is known only by its SHA-256 (the *owner*); everything a key creates is its own and
another key's ids get HTTP 403. Training runs and checkpoints live on disk under ``root`` and
outlive the process:

    ROOT/<model_id>/run.json                      owner, base model, LoRA spec
    ROOT/<model_id>/weights/<name>/               save_state: DCP (adapters, AdamW, step)
    ROOT/<model_id>/sampler_weights/<name>/       save_weights_for_sampler: HF export
    ROOT/<model_id>/ephemeral/<n>/                save_weights_and_get_sampling_client

and ``tinker://<model_id>/weights/<name>`` (``sampler_weights``) names those dirs. Live models
(their engines) and sessions are in memory: after a restart a run's checkpoints load into a new
model (``create_training_client_from_state``), its old model id answers 404 naming that.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from areal.tinker.trainer import ModelSpec, TinkerModel
from areal.tinker.wire import ApiError, bad

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a checkpoint name
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # <session id>:train:<seq>
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> checkpoint type
CHECKPOINT_META = "tinker_checkpoint.json"


def owner_of(api_key: str) -> str:
    """The owner id of an API key: its SHA-256, never the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass
class Run:
    """A training run (one ``create_model``): its owner, base model name and model spec."""

    model_id: str
    owner: str
    base_model: str
    spec: ModelSpec
    created: float = field(default_factory=time.time)


@dataclass
class Sampler:
    """A sampling session: pinned to the HF dir of one weight snapshot."""

    session_id: str
    owner: str
    base_model: str
    weights_dir: str
    model_path: str | None = None  # the tinker:// path it was made from, if any


@dataclass
class CheckpointPath:
    """A resolved ``tinker://<model_id>/<segment>/<name>``."""

    model_id: str
    kind: str  # "training" or "sampler"
    name: str
    dir: Path

    @property
    def tinker_path(self) -> str:
        segment = "weights" if self.kind == "training" else "sampler_weights"
        return f"tinker://{self.model_id}/{segment}/{self.name}"


class Registry:
    """The service's sessions, runs, live models and sampling sessions (thread-safe)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.models: dict[str, TinkerModel] = {}  # live model id -> engine
        self.samplers: dict[str, Sampler] = {}
        self._counters: dict[str, int] = {}

    # ---------------------------------------------------------------- sessions and ownership

    def new_session(self, owner: str) -> str:
        sid = f"session-{secrets.token_hex(8)}"
        with self._lock:
            self.sessions[sid] = owner
        return sid

    def check_session(self, session_id: str, owner: str) -> None:
        """404 for an unknown session id, 403 for another key's."""
        got = self.sessions.get(session_id)
        if got is None:
            raise ApiError(404, f"session_id: {session_id!r} is not a session of this service")
        if got != owner:
            raise ApiError(403, f"session_id: {session_id!r} belongs to another API key")

    def run(self, model_id: str, owner: str) -> Run:
        """The run of ``model_id`` (from disk); 404 when there is none, 403 for another key's."""
        path = self._run_file(model_id)
        if not path.is_file():
            raise ApiError(404, f"model_id: {model_id!r} is not a training run of this service")
        raw = json.loads(path.read_text())
        run = Run(raw["model_id"], raw["owner"], raw["base_model"], ModelSpec(**raw["spec"]))
        run.created = raw["created"]
        if run.owner != owner:
            raise ApiError(403, f"model_id: {model_id!r} belongs to another API key")
        return run

    def model(self, model_id: str, owner: str) -> TinkerModel:
        """The live engine of ``model_id``; 404 naming why when it is not loaded."""
        self.run(model_id, owner)  # 404 / 403 first
        engine = self.models.get(model_id)
        if engine is None:
            raise ApiError(
                404,
                f"model_id: {model_id!r} is not loaded (the service restarted or the model was "
                "closed); load its checkpoint into a new model with "
                "ServiceClient.create_training_client_from_state(tinker://.../weights/NAME)",
            )
        return engine

    def _run_file(self, model_id: str) -> Path:
        if not MODEL_ID.match(model_id):
            raise ApiError(404, f"model_id: {model_id!r} is not a model id of this service")
        return self.root / model_id / "run.json"

    # ---------------------------------------------------------------- runs and models

    def add_run(
        self, model_id: str, owner: str, base_model: str, spec: ModelSpec, engine: TinkerModel
    ) -> None:
        """Record a new run (``model_id`` is ``<session id>:train:<model_seq_id>``, the id the
        SDK derives itself) and its live engine."""
        path = self.root / model_id / "run.json"
        if path.exists():
            raise bad(f"model_seq_id: model {model_id!r} exists; use a new training client")
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = {**asdict(Run(model_id, owner, base_model, spec)), "spec": asdict(spec)}
        path.write_text(json.dumps(raw, indent=1))
        with self._lock:
            self.models[model_id] = engine

    def next_ephemeral(self, model_id: str) -> Path:
        with self._lock:
            n = self._counters.get(model_id, 0)
            self._counters[model_id] = n + 1
        return self.root / model_id / "ephemeral" / str(n)

    # ---------------------------------------------------------------- checkpoints

    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> CheckpointPath:
        """Where ``save_state`` (``training``) / ``save_weights_for_sampler`` (``sampler``)
        writes checkpoint ``name``."""
        if not NAME.match(name):
            raise bad(
                f"path: {name!r} is not a checkpoint name; use letters, digits, '.', '_' and "
                "'-' (at most 128)"
            )
        segment = "weights" if kind == "training" else "sampler_weights"
        return CheckpointPath(model_id, kind, name, self.root / model_id / segment / name)

    def resolve(self, tinker_path: str, owner: str, field_name: str = "path") -> CheckpointPath:
        """A ``tinker://<model_id>/(weights|sampler_weights)/<name>`` of ``owner``'s runs."""
        m = re.match(r"^tinker://([^/]+)/([^/]+)/([^/]+)$", tinker_path)
        if m is None or m.group(2) not in KINDS:
            raise bad(
                f"{field_name}: {tinker_path!r} is not a checkpoint path; expected "
                "tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>"
            )
        model_id, segment, name = m.groups()
        self.run(model_id, owner)  # 404 / 403
        ckpt = self.checkpoint_dir(model_id, KINDS[segment], name)
        if not (ckpt.dir / CHECKPOINT_META).is_file():
            raise ApiError(404, f"{field_name}: no checkpoint at {tinker_path!r}")
        return ckpt

    def record_checkpoint(self, ckpt: CheckpointPath, metadata: dict[str, str] | None) -> None:
        """Mark a finished checkpoint (listing and resolution look for this file)."""
        meta = {"time": time.time(), "type": ckpt.kind, "user_metadata": metadata or None}
        (ckpt.dir / CHECKPOINT_META).write_text(json.dumps(meta))

    def list_checkpoints(self, model_id: str, owner: str) -> list[dict]:
        """The run's checkpoints as the SDK's ``Checkpoint`` dicts, oldest first."""
        self.run(model_id, owner)
        out = []
        for segment, kind in KINDS.items():
            for meta_file in sorted((self.root / model_id / segment).glob(f"*/{CHECKPOINT_META}")):
                meta = json.loads(meta_file.read_text())
                ckpt = CheckpointPath(model_id, kind, meta_file.parent.name, meta_file.parent)
                size = sum(f.stat().st_size for f in ckpt.dir.rglob("*") if f.is_file())
                out.append(
                    {
                        "checkpoint_id": f"{segment}/{ckpt.name}",
                        "checkpoint_type": kind,
                        "time": datetime.fromtimestamp(meta["time"], UTC).isoformat(),
                        "tinker_path": ckpt.tinker_path,
                        "size_bytes": size,
                        "user_metadata": meta["user_metadata"],
                    }
                )
        return sorted(out, key=lambda c: c["time"])

    # ---------------------------------------------------------------- sampling sessions

    def add_sampler(
        self, session_id: str, seq: int, owner: str, base_model: str, weights_dir: str, path=None
    ) -> str:
        sid = f"{session_id}:sample:{seq}"
        with self._lock:
            if sid in self.samplers:
                raise bad(f"sampling_session_seq_id: {seq} already used in session {session_id}")
            self.samplers[sid] = Sampler(sid, owner, base_model, weights_dir, path)
        return sid

    def sampler(self, sampling_session_id: str, owner: str) -> Sampler:
        s = self.samplers.get(sampling_session_id)
        if s is None:
            raise ApiError(
                404, f"sampling_session_id: {sampling_session_id!r} is not a sampling session"
            )
        if s.owner != owner:
            raise ApiError(
                403, f"sampling_session_id: {sampling_session_id!r} belongs to another API key"
            )
        return s
