"""The vocabulary of a training step as data: model function calls (MFCs).

An :class:`MFC` names a model (role + replica), one of the uniform model functions of the
engines (:class:`ModelFn`; each returns :data:`~areal.api.engine.ModelFnResult`, a batch with
named fields added, and stats), the batch fields it reads and the ones it adds. A step is a
list of MFCs: Lite runs it in process (:func:`areal.runtime.step.run_step`), Core's master runs
the same list distributed (:mod:`areal.core.dfg` checks it and places it on model workers).

Each engine method that is a model function says, beside its code, which fields it adds and
whether it changes weights (:func:`model_fn`); :func:`added_fields` and
:func:`changes_weights` read those declarations, so a graph cannot lie about what a call
produces. A script's own model function is an MFC whose ``fn`` is the method's name (a string):
the runner calls it by that name, as it calls the library's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from areal.api.config.base import MicroBatchSpec


class ModelFn(enum.Enum):
    """The model functions an MFC can call: engine methods returning ``ModelFnResult``.

    ``generate`` is the rollout side (the inference engine and a workflow), not a train-engine
    method; the others are engine methods of the same name, each marked with :func:`model_fn`.
    """

    GENERATE = "generate"
    COMPUTE_LOGP = "compute_logp"  # FSDPEngine (actor's proximal logp, reference logp)
    COMPUTE_VALUES = "compute_values"  # PPOCritic
    COMPUTE_ADVANTAGES = "compute_advantages"  # PPOActor
    PPO_UPDATE = "ppo_update"  # PPOActor, PPOCritic
    TRAIN_LM = "train_lm"  # SFTEngine
    EVALUATE_LM = "evaluate_lm"  # SFTEngine
    TRAIN_RW = "train_rw"  # RWEngine
    SCORE = "score"  # RWEngine
    COMPUTE_SEQ_LOGP = "compute_seq_logp"  # DPOReference (each sequence's summed reply logp)
    TRAIN_DPO = "train_dpo"  # DPOEngine


# they change weights (their methods declare trains=True; Core's master reads this without them)
TRAINING_FNS = (ModelFn.PPO_UPDATE, ModelFn.TRAIN_LM, ModelFn.TRAIN_RW, ModelFn.TRAIN_DPO)
_LIBRARY = {f.value for f in ModelFn}  # the library's model function names


def fn_name(fn: ModelFn | str) -> str:
    """The engine method ``fn`` calls: a library function's value, or a script's method name."""
    return fn.value if isinstance(fn, ModelFn) else fn


@dataclass(frozen=True)
class Declared:
    """What a model function adds to its batch: ``adds``, plus the field named by each keyword
    of ``named`` (keyword -> its default, None: nothing unless the call passes it); ``trains``:
    it changes its model's weights (the runner steps the engine's LR schedule after it)."""

    adds: tuple[str, ...] = ()
    named: tuple[tuple[str, str | None], ...] = ()
    trains: bool = False


_DECLARED: dict[str, Declared] = {}  # method name -> its declaration (one per name)
F = TypeVar("F", bound=Callable[..., Any])


def model_fn(
    *adds: str, named: dict[str, str | None] | None = None, trains: bool = False
) -> Callable[[F], F]:
    """Mark an engine method as a model function and declare the fields it adds: the fixed
    ``adds``, and for each keyword of ``named`` the field the call names (``out="logp"``:
    ``compute_logp(batch, out="ref_logp")`` adds ``ref_logp``, ``out`` defaulting to ``logp``).
    ``trains=True``: the method changes its model's weights, so the runner steps the engine's
    LR schedule after each call and Core's master counts it as a training step. Methods of one
    name declare the same fixed fields and ``trains``; their keywords add up (the actor's
    ``ppo_update`` names ``logp_out``, the critic's names none)."""

    def mark(method: F) -> F:
        name = method.__name__
        decl = Declared(tuple(adds), tuple((named or {}).items()), trains)
        if name in _LIBRARY and trains != (ModelFn(name) in TRAINING_FNS):
            raise TypeError(
                f"model function {name} declared trains={trains}, but TRAINING_FNS (api/mfc.py) "
                f"says trains={not trains}; make the two agree"
            )
        prev = _DECLARED.get(name)
        if prev is not None and (prev.adds, prev.trains) != (decl.adds, decl.trains):
            raise TypeError(
                f"model function {name} declared as adding {list(decl.adds)} (trains={trains}) "
                f"here and {list(prev.adds)} (trains={prev.trains}) elsewhere; methods of one "
                "name add the same fields and train alike"
            )
        if prev is not None:
            named_all = tuple((dict(prev.named) | dict(decl.named)).items())
            decl = Declared(decl.adds, named_all, trains)
        _DECLARED[name] = decl
        return method

    return mark


def declared(fn: ModelFn | str) -> Declared | None:
    """How the engine methods named like ``fn`` declare it (None: no imported method does)."""
    return _DECLARED.get(fn_name(fn))


def changes_weights(fn: ModelFn | str) -> bool:
    """Whether ``fn`` changes its model's weights: a library training function
    (:data:`TRAINING_FNS`), or a method declared ``@model_fn(..., trains=True)``."""
    decl = declared(fn)
    return fn in TRAINING_FNS or (decl is not None and decl.trains)


def added_fields(fn: ModelFn | str, kwargs: dict[str, Any]) -> tuple[str, ...] | None:
    """The keys ``fn(batch, **kwargs)`` adds, as its engine methods declare them (None: a
    ``generate`` MFC, whose outputs are whatever it declares). The engines' modules must be
    imported (their classes declare the functions)."""
    if fn is ModelFn.GENERATE:
        return None
    decl = declared(fn)
    if decl is None:
        raise LookupError(
            f"no engine method declares model function {fn_name(fn)}; import the module that "
            "defines it (areal.engine.*, or your script's), or mark the method with @model_fn"
        )
    named = [kwargs.get(k, default) for k, default in decl.named]
    return (*decl.adds, *(n for n in named if n is not None))


@dataclass(frozen=True, order=True)
class ModelName:
    """A model of the graph: its role (actor, critic, ref, ...) and which replica of that role."""

    role: str
    replica: int = 0

    @classmethod
    def parse(cls, text: str) -> ModelName:
        """``"actor"`` or ``"actor@1"``."""
        role, _, replica = text.partition("@")
        if not role or (replica and not replica.isdigit()):
            raise ValueError(
                f"model name {text!r}: write ROLE or ROLE@REPLICA, e.g. 'actor' or 'actor@1'"
            )
        return cls(role, int(replica) if replica else 0)

    def __str__(self) -> str:
        return f"{self.role}@{self.replica}"


@dataclass(frozen=True)
class ParamRealloc:
    """An MFC hook: before the call, its model's weights become ``source``'s, moved from the
    source's layout to the model's (``ema`` > 0 keeps a share: ``ema * own + (1 - ema) * source``,
    e.g. a reference model refreshed from the actor)."""

    source: ModelName
    ema: float = 0.0


@dataclass(frozen=True)
class UpdateServers:
    """A hook of a ``generate`` MFC: before the call, the generation servers behind its model
    get ``source``'s weights if ``source`` was trained since the last push (the weight
    publisher: disk or broadcast), and the rollouts' version moves to ``source``'s."""

    source: ModelName


Hook = ParamRealloc | UpdateServers


@dataclass(frozen=True)
class MFC:
    """One model function call: ``model.fn(batch[inputs], **kwargs)`` adds ``outputs``.

    ``fn`` is a library model function (:class:`ModelFn`) or the name of an engine method
    marked with :func:`model_fn` (a script's own, e.g. ``"compute_entropy"``); a name that is a
    library function's becomes that member.

    ``mb_spec`` overrides the engine's own micro-batch split for this call (None: the engine's).
    ``hooks`` run before the call, in order (Core only). The stats names: in process the call
    runs in the tracker's timer ``timer`` (default: the MFC's name) and its stats are recorded
    under ``scope`` (``loss`` -> ``loss/<stat>``; empty: not recorded); Core logs the same stats
    under the same scope (:func:`areal.runtime.step.step_stats`).
    """

    name: str
    model: ModelName
    fn: ModelFn | str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    mb_spec: MicroBatchSpec | None = None
    hooks: tuple[Hook, ...] = ()
    timer: str = ""
    scope: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.fn, ModelFn):
            return
        if not self.fn.isidentifier() or self.fn.startswith("_"):
            raise ValueError(
                f"MFC {self.name!r}: fn {self.fn!r} is no engine method's name; name a public "
                "method marked @model_fn, e.g. 'compute_entropy'"
            )
        if self.fn in _LIBRARY:  # one spelling of each library function: its member
            object.__setattr__(self, "fn", ModelFn(self.fn))

    @property
    def models(self) -> set[ModelName]:
        """The models this call touches: its own and its hooks' sources."""
        return {self.model, *(h.source for h in self.hooks)}
