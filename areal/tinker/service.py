"""The Tinker-compatible training service (``areal tinker serve``): the work behind each route.

One trainer rank lives in this process (``torch.distributed`` of one rank, gloo on CPU) and
holds every training model the clients create (:class:`areal.tinker.trainer.TinkerModel`, one
FSDP engine each); their requests run in arrival order on one thread. One generator (our
embedded server's, in process) samples for every sampling session, each pinned to its weight
snapshot (:mod:`areal.tinker.sampling`). HTTP is in :mod:`areal.tinker.routes`; docs/tinker.md.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tinker import types
from torch.distributed.device_mesh import DeviceMesh

from areal.api.config.tinker import TinkerConfig
from areal.serving.generator import Generator
from areal.serving.model import read_hf_config
from areal.tinker.futures import FutureStore, Reply, SerialWorker
from areal.tinker.sampling import PinnedSampler, SampleJob, sampling_params
from areal.tinker.sessions import CheckpointPath, Registry, Run
from areal.tinker.trainer import ModelSpec, TinkerModel
from areal.tinker.wire import ForwardBackward, bad, check_forward_backward
from areal.tinker.wire import encode_forward_backward as encode_fb

PROTO = "application/x-protobuf"


def _json(obj: dict) -> Reply:
    return Reply(json.dumps(obj).encode())


def _destroyed(engine: TinkerModel) -> Reply:
    engine.destroy()
    return _json({})


class Service:
    """The registry, the futures and the two workers (trainer thread, sampler)."""

    def __init__(self, cfg: TinkerConfig, mesh: DeviceMesh, generator: Generator):
        self.cfg = cfg
        self.mesh = mesh
        self.base_dir = str(Path(cfg.model).expanduser())
        self.base_name = cfg.model_name or cfg.model
        self.hf = read_hf_config(self.base_dir)
        self.context = generator.context_length
        self.registry = Registry(cfg.root)
        self.futures = FutureStore()
        self.trainer = SerialWorker("tinker-trainer")
        self.sampler = PinnedSampler(generator, self.base_dir)
        self.model_session: dict[str, str] = {}  # live model id -> the session that made it

    # ---------------------------------------------------------------- names

    def check_base_model(self, name: str | None, field: str = "base_model") -> None:
        if name not in (self.base_name, self.cfg.model, self.base_dir):
            raise bad(
                f"{field}: {name!r} is not served here; this service serves {self.base_name!r}"
            )

    def queue(self, owner: str, fn) -> str:
        """Run ``fn`` on the trainer thread; the request id the client polls."""
        rid, entry = self.futures.create(owner)
        self.trainer.submit(fn, entry)
        return rid

    # ---------------------------------------------------------------- models

    def model_spec(self, req: types.CreateModelRequest) -> ModelSpec:
        """The spec of a new model, refusing what this service cannot train (400)."""
        if req.optimizer_config.type != "adamw":
            raise bad(f"optimizer_config.type: {req.optimizer_config.type!r}; only adamw is served")
        lc = req.lora_config
        rank = 0 if lc is None else lc.rank  # no lora_config: full fine-tuning
        if lc is not None and not 1 <= rank <= self.cfg.max_lora_rank:
            raise bad(f"lora_config.rank: {rank} must be in [1, {self.cfg.max_lora_rank}]")
        unembed = lc is not None and lc.train_unembed
        if unembed and self.hf.get("tie_word_embeddings", False):
            raise bad(
                "lora_config.train_unembed: this model ties lm_head to its input embeddings, so "
                "an lm_head adapter cannot be exported; pass train_unembed=False"
            )
        seed = lc.seed if lc is not None and lc.seed is not None else 1
        return ModelSpec(
            base_dir=self.base_dir,
            rank=rank,
            alpha=self.cfg.lora_alpha,
            seed=int(seed),
            train_attn=lc is None or lc.train_attn,
            train_mlp=lc is None or lc.train_mlp,
            train_unembed=unembed,
            dtype=self.cfg.dtype,
            max_tokens_per_mb=self.cfg.max_tokens_per_mb,
        )

    def new_engine(self, spec: ModelSpec) -> TinkerModel:
        engine = TinkerModel(spec, self.mesh)
        engine.initialize(None)
        return engine

    def create_model(self, owner: str, req: types.CreateModelRequest) -> str:
        self.registry.check_session(req.session_id, owner)
        self.check_base_model(req.base_model)
        spec = self.model_spec(req)

        model_id = f"{req.session_id}:train:{req.model_seq_id}"  # as the SDK derives it

        def run() -> Reply:
            self.registry.add_run(model_id, owner, self.base_name, spec, self.new_engine(spec))
            self.model_session[model_id] = req.session_id
            return _json({"model_id": model_id, "type": "create_model"})

        return self.queue(owner, run)

    def info(self, owner: str, model_id: str) -> dict:
        run = self.registry.run(model_id, owner)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": (self.hf.get("architectures") or [""])[0],
                "model_name": run.base_model,
                "tokenizer_id": self.base_dir,
            },
            "is_lora": run.spec.rank > 0,
            "lora_rank": run.spec.rank or None,
            "model_name": run.base_model,
        }

    def finish_session(self, owner: str, session_id: str) -> None:
        """Drop the session's live models (their runs and checkpoints stay on disk)."""
        self.registry.check_session(session_id, owner)
        for model_id in [m for m, s in self.model_session.items() if s == session_id]:
            del self.model_session[model_id]
            engine = self.registry.models.pop(model_id, None)
            if engine is not None:  # on the trainer thread, after the model's queued requests
                self.queue(owner, lambda e=engine: _destroyed(e))

    def training_run(self, run: Run) -> dict:
        """The SDK's ``TrainingRun`` of ``run``."""
        return {
            "training_run_id": run.model_id,
            "base_model": run.base_model,
            "model_owner": run.owner[:12],
            "is_lora": run.spec.rank > 0,
            "lora_rank": run.spec.rank or None,
            "last_request_time": datetime.fromtimestamp(run.created, UTC).isoformat(),
        }

    # ---------------------------------------------------------------- training

    def forward_backward(self, owner: str, req: ForwardBackward) -> str:
        engine = self.registry.model(req.model_id, owner)
        check_forward_backward(req, int(self.hf["vocab_size"]), self.cfg.max_batch_tokens)
        if req.loss_fn == "ppo":
            lo = req.config.get("clip_low_threshold", 0.8)
            hi = req.config.get("clip_high_threshold", 1.2)
            if not lo <= 1.0 <= hi:
                raise bad(
                    f"loss_fn_config: ppo needs clip_low_threshold <= 1 <= "
                    f"clip_high_threshold, got {lo} and {hi}"
                )

        def run() -> Reply:
            outputs, metrics = engine.forward_backward(
                req.data, req.loss_fn, req.config, req.forward_only
            )
            return Reply(encode_fb(outputs, metrics), PROTO)

        return self.queue(owner, run)

    def optim_step(self, owner: str, req: types.OptimStepRequest) -> str:
        engine = self.registry.model(req.model_id, owner)
        p = req.optim_params
        if not isinstance(p, types.AdamParams):
            raise bad(f"optim_params: {type(p).__name__} is not served; send AdamParams")
        checks = {
            "learning_rate": p.learning_rate >= 0,
            "beta1": 0 <= p.beta1 < 1,
            "beta2": 0 <= p.beta2 < 1,
            "eps": p.eps > 0,
            "weight_decay": p.weight_decay >= 0,
            "grad_clip_norm": p.grad_clip_norm >= 0,
        }
        for name, ok in checks.items():
            value = getattr(p, name)
            if not (ok and np.isfinite(value)):
                raise bad(f"adam_params.{name}: {value} is out of range (Adam's own bounds)")

        def run() -> Reply:
            metrics = engine.optim_step(
                p.learning_rate, (p.beta1, p.beta2), p.eps, p.weight_decay, p.grad_clip_norm
            )
            return _json({"metrics": metrics})

        return self.queue(owner, run)

    # ---------------------------------------------------------------- state

    def _target(self, model_id: str, kind: str, name: str, overwrite: bool) -> CheckpointPath:
        ckpt = self.registry.checkpoint_dir(model_id, kind, name)
        if ckpt.dir.exists() and not overwrite:
            raise bad(f"path: checkpoint {ckpt.tinker_path} exists; pick another name")
        return ckpt

    def save_state(self, owner: str, req: types.SaveWeightsRequest) -> str:
        engine = self.registry.model(req.model_id, owner)
        name = req.path or f"state-{engine.global_step:06d}"
        ckpt = self._target(req.model_id, "training", name, req.overwrite)

        def run() -> Reply:
            shutil.rmtree(ckpt.dir, ignore_errors=True)
            engine.save_state(str(ckpt.dir), optimizer=True)
            self.registry.record_checkpoint(ckpt, req.user_metadata)
            return _json({"path": ckpt.tinker_path, "type": "save_weights"})

        return self.queue(owner, run)

    def load_state(self, owner: str, req: types.LoadWeightsRequest) -> str:
        ckpt = self.registry.resolve(req.path, owner)
        if ckpt.kind != "training":
            raise bad(f"path: {req.path!r} is a sampler export; load_state needs a save_state path")
        src = self.registry.run(ckpt.model_id, owner).spec
        if req.model_id is not None:
            engine = self.registry.model(req.model_id, owner)
            if engine.tinker_spec != src:
                raise bad(
                    f"path: {req.path!r} holds a model of another shape ({src}); this "
                    f"model is {engine.tinker_spec}"
                )
            model_id, session_id = req.model_id, None
        elif req.session_id is not None and req.model_seq_id is not None:
            self.registry.check_session(req.session_id, owner)
            engine, session_id = None, req.session_id
            model_id = f"{req.session_id}:train:{req.model_seq_id}"  # as the SDK derives it
        else:
            raise bad("model_id: load_weights needs model_id, or session_id and model_seq_id")

        def run() -> Reply:
            nonlocal engine
            if engine is None:  # create-via-load: a new model shaped like the checkpoint's
                engine = self.new_engine(src)
                self.registry.add_run(model_id, owner, self.base_name, src, engine)
                self.model_session[model_id] = str(session_id)
            engine.load_state(str(ckpt.dir), optimizer=req.optimizer)
            return _json({"path": req.path, "model_id": model_id, "type": "load_weights"})

        return self.queue(owner, run)

    def save_for_sampler(self, owner: str, req: types.SaveWeightsForSamplerRequest) -> str:
        engine = self.registry.model(req.model_id, owner)
        if req.path is not None:
            ckpt = self._target(req.model_id, "sampler", req.path, overwrite=False)
            out = ckpt.dir
        else:
            if req.sampling_session_seq_id is None:
                raise bad("sampling_session_seq_id: needed when path is not given")
            ckpt, out = None, self.registry.next_ephemeral(req.model_id)
        session = self.model_session.get(req.model_id, "")
        run_info = self.registry.run(req.model_id, owner)

        def run() -> Reply:
            engine.export_for_sampler(str(out))
            if ckpt is not None:
                self.registry.record_checkpoint(ckpt, req.user_metadata)
                return _json({"path": ckpt.tinker_path, "type": "save_weights_for_sampler"})
            sid = self.registry.add_sampler(
                session, int(req.sampling_session_seq_id or 0), owner, run_info.base_model, str(out)
            )
            return _json({"sampling_session_id": sid, "type": "save_weights_for_sampler"})

        return self.queue(owner, run)

    # ---------------------------------------------------------------- sampling

    def create_sampler(self, owner: str, req: types.CreateSamplingSessionRequest) -> str:
        self.registry.check_session(req.session_id, owner)
        if req.model_path is not None:
            ckpt = self.registry.resolve(req.model_path, owner, "model_path")
            if ckpt.kind != "sampler":
                raise bad(
                    f"model_path: {req.model_path!r} is a save_state checkpoint; sample from a "
                    "save_weights_for_sampler path (tinker://.../sampler_weights/NAME)"
                )
            weights, base = str(ckpt.dir), self.registry.run(ckpt.model_id, owner).base_model
        else:
            self.check_base_model(req.base_model)
            weights, base = self.base_dir, self.base_name
        return self.registry.add_sampler(
            req.session_id, req.sampling_session_seq_id, owner, base, weights, req.model_path
        )

    def sample(self, owner: str, req: types.SampleRequest) -> str:
        if req.sampling_session_id is not None:
            weights = self.registry.sampler(req.sampling_session_id, owner).weights_dir
        elif req.model_path is not None:
            weights = str(self.registry.resolve(req.model_path, owner, "model_path").dir)
        else:
            self.check_base_model(req.base_model)
            weights = self.base_dir
        unsupported = {
            "topk_prompt_logprobs": req.topk_prompt_logprobs,
            "topk_sample_logprobs": req.topk_sample_logprobs,
            "target_prompt_logprobs": req.target_prompt_logprobs is not None,
            "prompt_alt_tokens_k": req.prompt_alt_tokens_k,
            "prompt_logprobs_last_n": req.prompt_logprobs_last_n is not None,
        }
        for name, value in unsupported.items():
            if value:
                raise bad(f"{name}: not served by this service yet; leave it unset")
        prompt = []
        for j, chunk in enumerate(req.prompt.chunks):
            if chunk.type != "encoded_text":
                raise bad(f"prompt.chunks[{j}]: {chunk.type} chunks are not supported; send tokens")
            prompt.extend(int(t) for t in chunk.tokens)  # pyright: ignore[reportAttributeAccessIssue]
        if not prompt:
            raise bad("prompt: no tokens")
        params = sampling_params(req, len(prompt), self.context, self.cfg.max_sample_tokens)
        rid, entry = self.futures.create(owner)
        self.sampler.submit(SampleJob(weights, prompt, params, bool(req.prompt_logprobs), entry))
        return rid

    def stop(self) -> None:
        self.trainer.stop()
        self.sampler.stop()
