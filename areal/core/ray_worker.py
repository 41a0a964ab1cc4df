"""Model workers as Ray actors: the :class:`~areal.core.worker.ModelWorker` interface, one process
per worker.

:func:`start_ray_workers` starts ``graph.n_workers`` actors on the Ray cluster this process is
attached to (``ray.init`` first). The actors join one ``torch.distributed`` job (gloo; rank =
worker index; the rendezvous is worker 0's node), every actor creates every model's mesh in the
same order (:func:`areal.runtime.dist.build_mesh` over the allocation's workers: ``pp x dp x
tp``, Core's allocation order), and each builds the engines of the models allocated to it from
:class:`EngineSpec` data. A layout that cannot work (pp above the model's layers, tp not
dividing its heads) is refused before any actor starts. Started actors can host another graph
(:func:`start_ray_workers` with ``actors=``, after :meth:`RayWorker.release`): the process and
its process group stay, meshes and engines are built anew. Inside, each actor runs
an :class:`~areal.core.worker.InProcessWorker` over its engines; its peers are the other actors,
whose stores it reads with Ray calls, so tensors go worker to worker.

Order. A Ray actor serving several calls at once (it must, to answer its peers' ``get`` while
it computes) does not promise to start them in arrival order, so the master-side
:class:`RayWorker` numbers its requests and the actor hands them to its worker strictly in that
order: the collectives of the ranks of a mesh still match.

Limits: one process per worker (``gpus_per_worker=1``: one GPU each, NCCL); every Ray call the
master makes waits at most ``RPC_TIMEOUT`` seconds (the master's ``mfc_timeout`` bounds MFCs).
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.experiments import DistillConfig
from areal.api.io import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.api.launch import disable_ray_token_auth, drop_torchrun_env
from areal.api.mfc import ModelFn, ModelName
from areal.api.protocols import Persistent, WeightSource
from areal.core.dfg import Allocation, DataflowGraph
from areal.core.realloc import Box
from areal.core.worker import (
    InProcessWorker,
    MFCReply,
    MFCRequest,
    ModelWorker,
    Moved,
    SampleFields,
)
from areal.runtime.dist import build_mesh, group_backend, mesh_groups
from areal.utils.batch import PackedBatch, split_by_tokens

if TYPE_CHECKING:
    from areal.engine.fsdp import FSDPEngine

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # areal/
RPC_TIMEOUT = 300.0  # seconds: a Ray call to a worker (setup loads models, so not short)
C = TypeVar("C", bound=TrainEngineConfig)


@dataclass(frozen=True)
class EngineSpec:
    """How a worker builds one model's engine on the sub-mesh it is given (data, so it travels)."""

    kind: Literal["ppo_actor", "ppo_critic", "lm", "sft", "rw"]
    config: TrainEngineConfig
    temperature: float = 1.0  # ppo_actor, lm: the rollout's sampling temperature
    group_size: int = 1  # ppo_actor, ppo_critic: gconfig.n_samples
    max_new_tokens: int | None = None  # ppo_actor
    ft_spec: FinetuneSpec | None = None  # sizes the LR schedule; None for frozen models
    distill: DistillConfig | None = None  # ppo_actor: on-policy distillation's advantages


def _config_as(spec: EngineSpec, cls: type[C]) -> C:
    """``spec.config`` as the config class its ``kind`` needs."""
    if not isinstance(spec.config, cls):
        raise ValueError(
            f"EngineSpec.config is a {type(spec.config).__name__}; kind={spec.kind!r} needs a "
            f"{cls.__name__} (the actor's or critic's config section)"
        )
    return spec.config


def build_engine(spec: EngineSpec, mesh: DeviceMesh) -> FSDPEngine:
    """The initialized Lite engine ``spec`` describes, sharded over ``mesh``. The engines (and
    transformers' models) are imported here, in the model workers, not by the master that starts
    them."""
    from areal.engine.fsdp import FSDPEngine
    from areal.engine.ppo import PPOActor, PPOCritic
    from areal.engine.rw import RWEngine
    from areal.engine.sft import SFTEngine

    engine: FSDPEngine
    if spec.kind == "ppo_actor":
        engine = PPOActor(
            _config_as(spec, PPOActorConfig),
            mesh,
            temperature=spec.temperature,
            group_size=spec.group_size,
            max_new_tokens=spec.max_new_tokens,
            distill=spec.distill,
        )
    elif spec.kind == "ppo_critic":
        engine = PPOCritic(_config_as(spec, PPOCriticConfig), mesh, group_size=spec.group_size)
    elif spec.kind == "lm":
        engine = FSDPEngine(spec.config, mesh, temperature=spec.temperature)
    elif spec.kind == "sft":
        engine = SFTEngine(spec.config, mesh)
    elif spec.kind == "rw":
        engine = RWEngine(spec.config, mesh)
    else:
        raise ValueError(f"EngineSpec.kind {spec.kind!r}: use ppo_actor, ppo_critic, lm, sft or rw")
    engine.initialize(spec.ft_spec)
    return engine


class _RayPeer:
    """Another actor's store, read with a Ray call."""

    def __init__(self, handle):
        self.handle = handle

    def get(self, sample_ids: tuple[int, ...], keys: tuple[str, ...]) -> list[SampleFields]:
        import ray

        return ray.get(self.handle.get.remote(sample_ids, keys), timeout=RPC_TIMEOUT)

    def read_shards(self, token: str, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        import ray

        return ray.get(self.handle.read_shards.remote(token, wanted), timeout=RPC_TIMEOUT)


class WorkerActor:
    """The body of one worker process (wrapped by ``ray.remote`` in :func:`start_ray_workers`)."""

    def __init__(self, index: int, n_workers: int, torch_threads: int, gpu: bool = False):
        self.index, self.n_workers, self.gpu = index, n_workers, gpu
        torch.set_num_threads(torch_threads)
        self.inner: InProcessWorker | None = None
        self._turn = 0  # number of the next request to hand to the worker
        self._order = threading.Condition()
        self._groups: list = []  # the process groups of this graph's meshes (release drops them)

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port there (worker 0 hosts the gloo rendezvous)."""
        import ray

        from areal.utils.network import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(
        self,
        host: str,
        port: int,
        allocations: list[Allocation],
        specs: dict[ModelName, EngineSpec],
        peers: list,
    ) -> None:
        """Join the job (once: a reused actor keeps its process group), build every model's mesh
        (all workers, same order), build my engines (a previous graph's are dropped first) on
        the new worker's request thread (:meth:`InProcessWorker.build` says why)."""
        import torch.distributed as dist

        backend, device = ("nccl", "cuda") if self.gpu else ("gloo", "cpu")
        if not dist.is_initialized():
            drop_torchrun_env()
            if self.gpu:  # Ray gives each worker actor one GPU as CUDA_VISIBLE_DEVICES: device 0
                torch.cuda.set_device(0)
            dist.init_process_group(
                group_backend(backend),
                init_method=f"tcp://{host}:{port}",
                rank=self.index,
                world_size=self.n_workers,
                timeout=datetime.timedelta(minutes=10),
            )
        self.release()
        meshes = {}
        for a in sorted(allocations, key=lambda a: a.model):
            mesh = build_mesh(device, a.workers, a.dp, a.tp, a.pp)  # collective: every worker
            if self.index in a.workers:
                meshes[a.model] = mesh
                self._groups += mesh_groups(mesh)
        self.inner = InProcessWorker(self.index, {})
        self.inner.build(lambda: {m: build_engine(specs[m], mesh) for m, mesh in meshes.items()})
        self.inner.connect(
            [self.inner if i == self.index else _RayPeer(h) for i, h in enumerate(peers)]
        )

    @property
    def worker(self) -> InProcessWorker:
        """The worker :meth:`setup` built (until :meth:`release`)."""
        if self.inner is None:
            raise RuntimeError(f"worker {self.index} is not set up: call setup() first")
        return self.inner

    def hosts(self, model: ModelName, fn: ModelFn | str) -> str | None:
        return self.worker.hosts(model, fn)

    def pid(self) -> int:
        """This worker's process id (``areal core status``)."""
        return os.getpid()

    def model_thread_stack(self) -> str:
        """Where this worker's model thread is now, innermost frames last (a hang report names
        the call each rank is stuck in; answered on one of the actor's free threads)."""
        frames = sys._current_frames()
        for thread in threading.enumerate():
            if thread.name.startswith("model-worker") and thread.ident in frames:
                stack = traceback.extract_stack(frames[thread.ident])
                ours = [f for f in stack[:-1] if f.filename.startswith(PACKAGE_DIR)]
                return "".join(traceback.format_list([*ours[-6:], stack[-1]]))  # + innermost
        return "(no model thread: the worker is not set up or idle since its last release)"

    def _in_turn(self, number: int, queue) -> Future:
        """Queue request ``number`` (0, 1, ...) on the worker only after all lower numbers."""
        with self._order:
            if not self._order.wait_for(lambda: self._turn == number, timeout=RPC_TIMEOUT):
                raise TimeoutError(
                    f"worker {self.index}: request {number} waited {RPC_TIMEOUT} s for "
                    f"request {self._turn}, which never arrived"
                )
            future = queue()
            self._turn += 1
            self._order.notify_all()
        return future

    def run(self, number: int, request: MFCRequest) -> MFCReply:
        """Run one MFC share, in the master's order."""
        return self._in_turn(number, lambda: self.worker.submit(request)).result()

    def run_call(self, number: int, model: ModelName, method: str, args: tuple) -> Any:
        """``engine.method(*args)`` on this rank, in the master's order (save, load, evaluate)."""
        return self._in_turn(number, lambda: self.worker.submit_call(model, method, *args)).result()

    def publish_shards(
        self, number: int, model: ModelName, token: str, layout: Allocation, n_readers: int
    ) -> None:
        self._in_turn(
            number, partial(self.worker.publish_shards, model, token, layout, n_readers)
        ).result()

    def load_shards(
        self,
        number: int,
        model: ModelName,
        token: str,
        source: Allocation,
        target: Allocation,
        ema: float,
    ) -> Moved:
        load = partial(self.worker.load_shards, model, token, source, target, ema)
        return self._in_turn(number, load).result()

    def read_shards(self, token: str, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        """A peer's read: the boxes leave on the host (a peer may have another device)."""
        return [t.cpu() for t in self.worker.read_shards(token, wanted)]

    def put(self, sample_ids: list[int], batch: PackedBatch) -> None:
        self.worker.put(sample_ids, batch)

    def get(self, sample_ids: tuple[int, ...], keys: tuple[str, ...]) -> list[SampleFields]:
        return self.worker.get(sample_ids, keys)

    def free(self, items: list[tuple[str, int]]) -> None:
        self.worker.free(items)

    def collective_counts(self) -> dict[tuple[int, ...], int]:
        """Collectives issued so far on each process group this worker belongs to, keyed by the
        group's global ranks (c10d's per-group sequence number; functional collectives count
        too). Which groups a step advanced shows which workers its collectives spanned."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _world

        return {
            tuple(dist.get_process_group_ranks(pg)): pg._get_sequence_number_for_group()  # pyright: ignore[reportAttributeAccessIssue]  # a C++ binding torch's stub lacks
            for pg in _world.pg_map
        }

    def parameters(self, model: ModelName) -> dict[str, tuple[tuple[int, ...], str]]:
        """Where this worker's part of ``model`` lies: each parameter it holds (a pipeline stage
        holds its own) with its local shape and its placements (``""`` for a plain tensor)."""
        from torch.distributed.tensor import DTensor

        return {
            name: (
                tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
                str(tuple(p.placements)) if isinstance(p, DTensor) else "",
            )
            for name, p in self.worker.engines[model].model.named_parameters()
        }

    def release(self) -> None:
        """Drop this worker's engines, store, request numbering and mesh groups; the process and
        its default process group stay, ready for another graph's :meth:`setup`."""
        import torch.distributed as dist

        if self.inner is not None:
            self.inner.close()
            for engine in self.inner.engines.values():
                engine.destroy()
            self.inner = None
        self._turn = 0
        for pg in self._groups:  # a reused actor's next graph builds its own meshes
            dist.destroy_process_group(pg)
        self._groups = []

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.release()
        if dist.is_initialized():
            dist.destroy_process_group()


class RayWorker(ModelWorker):
    """The master's handle on one :class:`WorkerActor`."""

    def __init__(self, index: int, handle):
        import ray

        self.index, self.handle, self._ray = index, handle, ray
        self._next = 0
        self._numbering = threading.Lock()

    def _call(self, ref):
        return self._ray.get(ref, timeout=RPC_TIMEOUT)

    def hosts(self, model: ModelName, fn: ModelFn | str) -> str | None:
        return self._call(self.handle.hosts.remote(model, fn))

    def model_thread_stack(self) -> str:
        """:meth:`WorkerActor.model_thread_stack`, or why it could not be read (10 s)."""
        try:
            return self._ray.get(self.handle.model_thread_stack.remote(), timeout=10)
        except Exception as e:  # a dead or wedged process: the report says so
            return f"(no answer: {type(e).__name__}: {e})"

    def submit(self, request: MFCRequest) -> Future[MFCReply]:
        return self._numbered(self.handle.run, request)

    def lost(self, error: BaseException) -> bool:
        """The actor died or was killed (not an error raised by its call)."""
        return isinstance(error, self._ray.exceptions.RayActorError)

    def _numbered(self, method, *args) -> Future:
        with self._numbering:  # the master's thread and a generation worker's both call
            ref = method.remote(self._next, *args)
            self._next += 1
        return ref.future()

    def call(self, model: ModelName, method: str, *args: Any) -> Future[Any]:
        """``engine.method(*args)`` on this rank, ordered with the MFCs."""
        return self._numbered(self.handle.run_call, model, method, args)

    def publish_shards(
        self, model: ModelName, token: str, layout: Allocation, n_readers: int
    ) -> Future[None]:
        return self._numbered(self.handle.publish_shards, model, token, layout, n_readers)

    def load_shards(
        self, model: ModelName, token: str, source: Allocation, target: Allocation, ema: float
    ) -> Future[Moved]:
        return self._numbered(self.handle.load_shards, model, token, source, target, ema)

    def read_shards(self, token: str, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        return self._call(self.handle.read_shards.remote(token, wanted))

    def put(self, sample_ids: list[int], batch: PackedBatch) -> None:
        self._call(self.handle.put.remote(sample_ids, batch))

    def get(self, sample_ids: tuple[int, ...], keys: tuple[str, ...]) -> list[SampleFields]:
        return self._call(self.handle.get.remote(sample_ids, keys))

    def free(self, items: list[tuple[str, int]]) -> None:
        self._call(self.handle.free.remote(items))

    def close(self) -> None:
        try:
            self._call(self.handle.shutdown.remote())
        finally:
            self._ray.kill(self.handle, no_restart=True)

    def release(self) -> None:
        """Drop the worker's engines but keep its actor, for another graph
        (:func:`start_ray_workers` with ``actors=``)."""
        self._call(self.handle.release.remote())


def ray_cpus(n_workers: int, cpus_per_worker: float) -> int:
    """CPUs a local Ray instance needs for ``n_workers`` worker actors."""
    return max(1, math.ceil(n_workers * cpus_per_worker))


def attach_ray(address: str, num_cpus: int) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``) once; with neither, start a local
    instance on the loopback address (its workers rendezvous there: a machine's other addresses
    may refuse local connections) with ``num_cpus`` CPUs (what the workers ask for: the process
    may be pinned to fewer cores, from which Ray would size the instance)."""
    import ray

    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or None, log_to_driver=False, include_dashboard=False)
    else:
        disable_ray_token_auth()
        ray.init(
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            include_dashboard=False,
        )


def check_layouts(allocations: list[Allocation], specs: dict[ModelName, EngineSpec]) -> None:
    """Raise ``ValueError`` (one line: the model, its layout, the field and the fix) for a layout
    its model cannot take: tp not dividing its heads or width, more stages than decoder layers.
    Reads only each model's config.json, before any worker starts."""
    from transformers import AutoConfig

    from areal.engine.pipeline import check_pipeline
    from areal.engine.tensor_parallel import check_tensor_parallel

    for a in allocations:
        if a.tp == 1 and a.pp == 1:
            continue
        path = specs[a.model].config.path
        try:
            hf_config = AutoConfig.from_pretrained(path)
            if a.tp > 1:
                check_tensor_parallel(hf_config, a.tp)
            if a.pp > 1:
                check_pipeline(hf_config, a.pp, path)
        except (ValueError, OSError) as e:
            raise ValueError(f"model '{a.model}' ({a.describe()}): {e}") from None


def start_worker_actors(
    n_workers: int, cpus_per_worker: float = 1, torch_threads: int = 1, gpus_per_worker: int = 0
) -> list:
    """``n_workers`` :class:`WorkerActor` processes, not yet set up (``ray.init`` must have run):
    pass them to :func:`start_ray_workers` as ``actors``. ``gpus_per_worker=1``: each gets one
    GPU from Ray's placement and the job runs NCCL (0: CPU, gloo)."""
    if gpus_per_worker not in (0, 1):
        raise ValueError(
            f"gpus_per_worker={gpus_per_worker}: a model worker uses no GPU (0) or one (1)"
        )
    import ray

    actor_cls = ray.remote(WorkerActor)
    return [
        actor_cls.options(
            num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_concurrency=16, max_restarts=0
        ).remote(i, n_workers, torch_threads, bool(gpus_per_worker))
        for i in range(n_workers)
    ]


def start_ray_workers(
    graph: DataflowGraph,
    specs: dict[ModelName, EngineSpec],
    cpus_per_worker: float = 1,
    torch_threads: int = 1,
    gpus_per_worker: int = 0,
    actors: list | None = None,
) -> list[RayWorker]:
    """One worker actor per model worker of ``graph`` (generation workers excluded: they are the
    caller's), hosting the graph's models; ``ray.init`` must have run. ``actors``: reuse these
    (from :func:`start_worker_actors`, released), else start new ones (``gpus_per_worker=1``:
    one GPU each, NCCL)."""
    import ray

    generating = {
        m.model for m in graph.mfcs if m.fn is ModelFn.GENERATE
    }  # generation workers host them
    missing = [str(m) for m in graph.allocations if m not in specs and m not in generating]
    if missing:
        raise ValueError(f"no EngineSpec for models {missing}; give every allocated model one")
    allocations = [a for m, a in graph.allocations.items() if m not in generating]
    n_model = 1 + max(w for a in allocations for w in a.workers)
    if any(w < n_model for m in generating for w in graph.allocations[m].workers):
        raise ValueError(
            f"generation workers must come after the {n_model} model workers in the allocation"
        )
    check_layouts(allocations, specs)
    if actors is None:
        actors = start_worker_actors(n_model, cpus_per_worker, torch_threads, gpus_per_worker)
    elif len(actors) < n_model:
        raise ValueError(
            f"actors: {len(actors)} given for a graph of {n_model} model workers; pass at least "
            f"{n_model}"
        )
    host, port = ray.get(actors[0].rendezvous.remote(), timeout=RPC_TIMEOUT)
    ray.get(  # every actor of the job builds every mesh; those past n_model host nothing
        [a.setup.remote(host, port, allocations, specs, actors) for a in actors],
        timeout=RPC_TIMEOUT,
    )
    return [RayWorker(i, a) for i, a in enumerate(actors[:n_model])]


class RayModel(WeightSource, Persistent):
    """One model on Ray workers, seen by an entry script as its engine: ``save``/``load`` (HF
    export, recover checkpoints), the weight source's calls (:mod:`areal.api.protocols`) and
    ``evaluate_lm`` run on every rank of the model's mesh."""

    def __init__(
        self,
        workers: list[RayWorker],
        model: ModelName,
        ranks: tuple[int, ...],
        layout: Allocation | None = None,
    ):
        """``ranks``: the model's workers; ``layout``: its allocation (default: ``ranks`` all
        data-parallel), which tells ``evaluate_lm`` the workers of each dp rank."""
        self.workers, self.model, self.ranks = workers, model, ranks
        self.layout = layout if layout is not None else Allocation(model, ranks, dp=len(ranks))

    def _on_ranks(self, method: str, args: list[tuple]) -> list[Any]:
        futures = [self.workers[w].call(self.model, method, *a) for w, a in zip(self.ranks, args)]
        try:
            return [f.result(timeout=RPC_TIMEOUT) for f in futures]
        except TimeoutError:
            where = "\n".join(
                f"worker {w} ({'answered' if f.done() else 'no answer'}), model thread at:\n"
                + self.workers[w].model_thread_stack()
                for w, f in zip(self.ranks, futures)
            )
            raise TimeoutError(
                f"{self.model}.{method} on workers {self.ranks}: no answer from every rank "
                f"within {RPC_TIMEOUT:g} s (a rank stuck in a collective its peers never "
                f"joined, or a dead peer):\n{where}"
            ) from None

    def save(self, meta: SaveLoadMeta) -> None:
        self._on_ranks("save", [(meta,)] * len(self.ranks))

    def load(self, meta: SaveLoadMeta) -> None:
        self._on_ranks("load", [(meta,)] * len(self.ranks))

    # The weight source of the publisher (areal/runtime/publisher.py): the collective parts run
    # on every rank, in order with the MFCs.
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self._on_ranks("update_weights", [(meta,)] * len(self.ranks))

    def init_weight_update_group(self, meta: WeightUpdateMeta, world_size: int) -> None:
        self._on_ranks("init_weight_update_group", [(meta, world_size)] * len(self.ranks))

    def weight_announcement(self) -> dict[str, list]:
        return self._on_ranks("weight_announcement", [()] * len(self.ranks))[0]

    def get_version(self) -> int:
        return self._on_ranks("get_version", [()] * len(self.ranks))[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full weights, gathered on its mesh's first rank and sent to the caller
        (every rank joins the gather; ``areal replay`` hashes them after each step)."""
        return self._on_ranks("full_state_dict", [()] * len(self.ranks))[0]

    def set_version(self, version: int) -> None:
        self._on_ranks("set_version", [(version,)] * len(self.ranks))

    def evaluate_lm(self, batch: PackedBatch) -> tuple[PackedBatch, dict[str, float]]:
        """The engine's held-out NLL over ``batch`` split by tokens across the dp ranks (each dp
        rank's share to all its stages and tp ranks; the stats are reduced over the mesh; the
        returned batch is the first rank's share)."""
        parts = split_by_tokens(batch.seqlens.tolist(), self.layout.dp, 1)
        shares = [batch.select(parts[self.layout.coordinate(w)[1]]) for w in self.ranks]
        return self._on_ranks("evaluate_lm", [(share,) for share in shares])[0]
