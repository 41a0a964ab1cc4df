"""The ``ray`` name registry: the key-value store in a named, detached Ray actor that every
process of one Ray cluster reaches (see :mod:`areal.utils.name_resolve`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

from areal.utils.name_resolve import KeyValueStore, RegistryUnavailableError, StoreRepository

R = TypeVar("R")  # what a store operation returns
Args = TypeVarTuple("Args")  # its arguments after the store


class RayNameRepository(StoreRepository):
    """The store in a detached Ray actor named ``name_resolve:<namespace>`` (Ray namespace
    ``areal``), created by the first process that asks for it (``get_if_exists``): every
    process connected to the same Ray cluster reaches the same one. Calls run one at a time in
    the actor, so ``add`` without ``replace`` is atomic."""

    RAY_NAMESPACE = "areal"

    def __init__(self, address: str, namespace: str, timeout: float):
        try:
            import ray
        except ImportError as e:
            raise ImportError(
                f"cluster.name_resolve.type=ray needs Ray ({e}); pip install -e '.[ray]' in the "
                "areal checkout"
            ) from None
        self._ray = ray
        self.timeout = timeout
        if not ray.is_initialized():
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as e:
                raise RegistryUnavailableError(
                    f"no Ray cluster at {address!r} (cluster.name_resolve.ray_address): {e}; start "
                    "one with `ray start --head` or set cluster.name_resolve.ray_address to its "
                    "GCS host:port"
                ) from e
        self.actor_name = f"name_resolve:{namespace}"
        self.where = f"the Ray actor {self.actor_name!r}"
        actor_class = ray.remote(num_cpus=0)(KeyValueStore)
        self.actor = actor_class.options(
            name=self.actor_name,
            namespace=self.RAY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
        ).remote()

    def _call(self, op: Callable[[KeyValueStore, *Args], R], *args: *Args) -> R:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return self._ray.get(self.actor.apply.remote(op, *args), timeout=self.timeout)
        except (GetTimeoutError, RayActorError) as e:
            raise RegistryUnavailableError(
                f"{self.where} did not answer {op.__name__} within {self.timeout} s "
                f"(cluster.name_resolve.timeout): {type(e).__name__}: {e}; check the Ray cluster "
                "(`ray status`)"
            ) from e
