"""A small key-value registry through which the processes of one trial find each other
(generation servers publish ``host:port``; clients list them).

Keys are ``/``-separated paths; a *subtree* is every key under a prefix. The keys of one trial
live under :func:`trial_key`; a launcher clears that subtree before it starts anything, so a
relaunched or repeated trial never sees the addresses of dead servers. One interface
(:class:`NameRepository`), four backends, chosen by ``cluster.name_resolve.type``:

- :class:`FileNameRepository` (``file``): one file per key under a root directory; on a shared
  filesystem (NFS) every machine sees the same registry. Writes are atomic (temp file, then
  rename, or hard link when the key must not exist yet).
- :class:`MemoryNameRepository` (``memory``): a dict inside one process, for tests and
  single-process runs.
- :class:`EtcdNameRepository` (``etcd``): keys in an etcd v3 server through its JSON gateway
  (client ``etcd3gw``). Every entry a process writes hangs on one lease that a thread of that
  process refreshes, so the entries of a process that dies (even by SIGKILL) vanish within
  ``cluster.name_resolve.ttl`` seconds.
- :class:`RayNameRepository` (``ray``): a named, detached Ray actor holding the dict, for the
  processes of one Ray cluster; it lives until the cluster stops.

The file root doubles as the namespace of the etcd and Ray registries, so runs under different
roots never see each other's keys there either.
"""

from __future__ import annotations

import abc
import base64
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from areal.utils.logging import get_logger

if TYPE_CHECKING:  # type-only: utils sits below api
    from areal.api.config.launcher import NameResolveConfig

logger = get_logger("name_resolve")


class NameEntryNotFoundError(KeyError):
    """No value is registered under the key."""


class NameEntryExistsError(KeyError):
    """A value is already registered under the key and ``replace`` was False."""


class RegistryUnavailableError(ConnectionError):
    """The registry's server (etcd, the Ray actor) did not answer, or this process's lease on
    its own entries expired; the message names the address and the config field to fix."""


def _clean(name: str) -> str:
    parts = [p for p in name.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"bad registry key {name!r}: use a/b/c with no '.' or '..' parts")
    return "/".join(parts)


class NameRepository(abc.ABC):
    """Registry interface; every method is safe to call from several threads."""

    @abc.abstractmethod
    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``; raises NameEntryExistsError unless ``replace``.
        Of several processes adding one absent key without ``replace``, exactly one wins."""

    @abc.abstractmethod
    def get(self, name: str) -> str:
        """The value under ``name``; raises NameEntryNotFoundError."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; raises NameEntryNotFoundError if absent."""

    @abc.abstractmethod
    def find_subtree(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (the prefix itself included if set), sorted."""

    def close(self) -> None:
        """Release what the registry holds (the etcd lease: this process's entries go at once)."""

    def __enter__(self) -> NameRepository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_subentry(self, prefix: str, value: str) -> str:
        """Register ``value`` under a fresh unique key below ``prefix``; returns that key."""
        name = f"{_clean(prefix)}/{uuid.uuid4().hex[:12]}"
        self.add(name, value)
        return name

    def get_subtree(self, prefix: str) -> list[str]:
        """Values of every key under ``prefix``, ordered by key."""
        out = []
        for key in self.find_subtree(prefix):
            try:
                out.append(self.get(key))
            except NameEntryNotFoundError:  # deleted between listing and reading
                continue
        return out

    def clear_subtree(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""
        for key in self.find_subtree(prefix):
            try:
                self.delete(key)
            except NameEntryNotFoundError:
                continue

    def wait_subtree(
        self, prefix: str, count: int, timeout: float, poll_interval: float = 0.1
    ) -> list[str]:
        """Block until at least ``count`` values are under ``prefix`` (at most ``timeout``
        seconds) and return all of them, ordered by key."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.get_subtree(prefix)
            if len(values) >= count:
                return values
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"registry key {_clean(prefix)!r} holds {len(values)} of {count} entries after "
                    f"{timeout} s; check that the processes that register there started (their "
                    "logs under RUN_DIR/logs) and use the same cluster.name_resolve settings"
                )
            time.sleep(poll_interval)

    def wait(self, name: str, timeout: float, poll_interval: float = 0.1) -> str:
        """Block until ``name`` is set (at most ``timeout`` seconds) and return its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.get(name)
            except NameEntryNotFoundError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"registry key {name!r} was not set within {timeout} s; check that the "
                        "process that publishes it is running and uses the same cluster.name_resolve "
                        "settings"
                    ) from None
                time.sleep(poll_interval)


class FileNameRepository(NameRepository):
    """One file per key: ``<root>/<key>/ENTRY``. Safe across processes and machines (NFS)."""

    _ENTRY = "ENTRY"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.root / _clean(name) / self._ENTRY

    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``. Readers never see half a value: the value is
        written to a temp file, then renamed over the key (``replace``) or hard-linked to it,
        which fails if the key exists, atomically, also on NFS."""
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{self._ENTRY}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(str(value))
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise NameEntryExistsError(
                f"registry key {_clean(name)!r} is already set in {self.root}; pass replace=True "
                "to overwrite it"
            ) from None
        except OSError as e:
            raise OSError(
                f"the file registry at {self.root} needs a filesystem with hard links (local disk, "
                f"NFS) for atomic adds; linking {path} failed: {e}; set cluster.name_resolve.file_root "
                "to such a directory or use cluster.name_resolve.type=etcd"
            ) from e
        finally:
            tmp.unlink()

    def get(self, name: str) -> str:
        """The value under ``name``."""
        try:
            return self._path(name).read_text()
        except FileNotFoundError:
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in {self.root}"
            ) from None

    def delete(self, name: str) -> None:
        """Remove ``name`` (empty parent directories are left; listing ignores them)."""
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in {self.root}"
            ) from None

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under ``prefix``."""
        base = self.root / _clean(prefix)
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            if self._ENTRY in files:
                keys.append(Path(dirpath).relative_to(self.root).as_posix())
        return sorted(keys)


class _KeyValueStore:
    """A dict of clean keys behind a lock: the memory registry, and the Ray actor's state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kv: dict[str, str] = {}

    def put(self, name: str, value: str, replace: bool) -> bool:
        """Set ``name``; False (and nothing changed) if it exists and not ``replace``."""
        with self._lock:
            if name in self._kv and not replace:
                return False
            self._kv[name] = value
            return True

    def get(self, name: str) -> str | None:
        with self._lock:
            return self._kv.get(name)

    def delete(self, name: str) -> bool:
        with self._lock:
            return self._kv.pop(name, None) is not None

    def items(self, prefix: str) -> list[tuple[str, str]]:
        """(key, value) of ``prefix`` and every key below it, sorted by key."""
        with self._lock:
            return sorted(
                (k, v) for k, v in self._kv.items() if k == prefix or k.startswith(prefix + "/")
            )

    def delete_subtree(self, prefix: str) -> None:
        with self._lock:
            for key in [k for k in self._kv if k == prefix or k.startswith(prefix + "/")]:
                del self._kv[key]

    def apply(self, op: Callable[..., Any], *args: Any) -> Any:
        """``op(self, *args)``: how a Ray caller runs one of the methods above in the actor."""
        return op(self, *args)


class _StoreRepository(NameRepository):
    """A registry over a :class:`_KeyValueStore` reached through ``_call(op, *args)``."""

    where: str  # where the store lives, for error messages

    @abc.abstractmethod
    def _call(self, op: Callable[..., Any], *args: Any) -> Any:
        """``op(store, *args)`` for a method ``op`` of :class:`_KeyValueStore`, wherever the store is."""

    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``."""
        if not self._call(_KeyValueStore.put, _clean(name), str(value), replace):
            raise NameEntryExistsError(
                f"registry key {_clean(name)!r} is already set in {self.where}; pass replace=True "
                "to overwrite it"
            )

    def get(self, name: str) -> str:
        """The value under ``name``."""
        value = self._call(_KeyValueStore.get, _clean(name))
        if value is None:
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in {self.where}"
            )
        return value

    def delete(self, name: str) -> None:
        """Remove ``name``."""
        if not self._call(_KeyValueStore.delete, _clean(name)):
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in {self.where}"
            )

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under ``prefix``."""
        return [key for key, _ in self._call(_KeyValueStore.items, _clean(prefix))]

    def get_subtree(self, prefix: str) -> list[str]:
        """Values under ``prefix`` (one call: a consistent snapshot)."""
        return [value for _, value in self._call(_KeyValueStore.items, _clean(prefix))]

    def clear_subtree(self, prefix: str) -> None:
        """Delete every key under ``prefix`` at once."""
        self._call(_KeyValueStore.delete_subtree, _clean(prefix))


class MemoryNameRepository(_StoreRepository):
    """A registry inside this process only: share the object, not the config."""

    where = "this process's memory registry"

    def __init__(self) -> None:
        self._store = _KeyValueStore()

    def _call(self, op: Callable[..., Any], *args: Any) -> Any:
        return op(self._store, *args)


class RayNameRepository(_StoreRepository):
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
                f"cluster.name_resolve.type=ray needs Ray ({e}); pip install -e '.[ray]' in the areal checkout"
            ) from None
        self._ray = ray
        self.timeout = timeout
        if not ray.is_initialized():
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as e:
                raise RegistryUnavailableError(
                    f"no Ray cluster at {address!r} (cluster.name_resolve.ray_address): {e}; start "
                    "one with `ray start --head` or set cluster.name_resolve.ray_address to its GCS "
                    "host:port"
                ) from e
        self.actor_name = f"name_resolve:{namespace}"
        self.where = f"the Ray actor {self.actor_name!r}"
        actor_class = ray.remote(num_cpus=0)(_KeyValueStore)
        self.actor = actor_class.options(
            name=self.actor_name,
            namespace=self.RAY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
        ).remote()

    def _call(self, op: Callable[..., Any], *args: Any) -> Any:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return self._ray.get(self.actor.apply.remote(op, *args), timeout=self.timeout)
        except (GetTimeoutError, RayActorError) as e:
            raise RegistryUnavailableError(
                f"{self.where} did not answer {op.__name__} within {self.timeout} s "
                f"(cluster.name_resolve.timeout): {type(e).__name__}: {e}; check the Ray cluster "
                "(`ray status`)"
            ) from e


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdNameRepository(NameRepository):
    """Keys ``<prefix>/<namespace>/<key>`` in an etcd v3 server (>= 3.4) through its JSON
    gateway. The first ``add`` grants a lease of ``ttl`` seconds that a daemon thread refreshes
    every ``ttl/3`` s; every entry this object writes hangs on it. A process that dies stops
    refreshing, and etcd deletes its entries within ``ttl`` s; :meth:`close` revokes the lease,
    deleting them at once. ``add`` without ``replace`` is one transaction (create only if the
    key has no revision). Each thread talks to etcd through its own HTTP session."""

    def __init__(
        self, address: str, namespace: str, ttl: int, timeout: float, prefix: str = "areal"
    ):
        import etcd3gw  # a dependency of areal, imported here so the other backends never load it
        import etcd3gw.exceptions

        host, _, port = address.rpartition(":")
        if not (host and port.isdigit()):
            raise ValueError(
                f"cluster.name_resolve.etcd_address must be host:port, got {address!r}"
            )
        self.address, self.ttl, self.timeout = address, ttl, timeout
        self._etcd3gw, self._host, self._port = etcd3gw, host, int(port)
        self._root = (
            "/".join(p for p in (prefix.strip("/"), namespace.strip("/")) if p) + "/"
        ).encode()
        self._local = threading.local()
        self._lease_lock = threading.Lock()
        self._lease: Any = None  # etcd3gw.Lease, granted by the first add
        self._lease_lost = ""  # why this process's entries are gone, set by the keep-alive thread
        self._stop = threading.Event()
        self._request("answer a status request", lambda client: client.status())

    def _key(self, name: str) -> bytes:
        return self._root + _clean(name).encode()

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._etcd3gw.client(
                host=self._host, port=self._port, timeout=self.timeout, api_path="/v3/"
            )
            self._local.client = client
        return client

    def _request(self, what: str, call: Callable[[Any], Any]) -> Any:
        try:
            return call(self._client())
        except self._etcd3gw.exceptions.Etcd3Exception as e:
            raise RegistryUnavailableError(
                f"etcd at {self.address} (cluster.name_resolve.etcd_address) did not {what}: "
                f"{type(e).__name__}: {e} {e.detail_text or ''}; start etcd there or point "
                "cluster.name_resolve.etcd_address at a running one (etcd >= 3.4, whose /health "
                "answers)"
            ) from e

    def _owned_lease(self) -> Any:
        with self._lease_lock:
            if self._lease_lost:
                raise RegistryUnavailableError(self._lease_lost)
            if self._lease is None:
                self._lease = self._request(
                    "grant a lease", lambda client: client.lease(ttl=self.ttl)
                )
                threading.Thread(
                    target=self._keep_alive,
                    args=(self._lease.id,),
                    name="name-resolve-lease",
                    daemon=True,
                ).start()
            return self._lease

    def _keep_alive(self, lease_id: int) -> None:
        period = self.ttl / 3  # seconds; two refreshes may fail before the lease runs out
        while not self._stop.wait(period):
            try:
                remaining = self._etcd3gw.Lease(lease_id, self._client()).refresh()
            except self._etcd3gw.exceptions.Etcd3Exception as e:
                logger.warning(
                    f"etcd at {self.address}: lease refresh failed ({e}); retrying in {period:.1f} s"
                )
                continue
            if remaining <= 0:
                self._lease_lost = (
                    f"the etcd lease of this process's registry entries at {self.address} expired "
                    f"(etcd unreachable, or this process stalled, for more than "
                    f"cluster.name_resolve.ttl={self.ttl} s): its entries are gone; check the etcd "
                    "server or raise cluster.name_resolve.ttl"
                )
                logger.error(self._lease_lost)
                return

    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name`` on this process's lease."""
        key, data, lease = self._key(name), str(value).encode(), self._owned_lease()
        if replace:
            self._request(f"put {name!r}", lambda client: client.put(key, data, lease=lease))
        elif not self._request(
            f"create {name!r}", lambda client: client.create(key, data, lease=lease)
        ):
            raise NameEntryExistsError(
                f"registry key {_clean(name)!r} is already set in etcd at {self.address}; pass "
                "replace=True to overwrite it"
            )

    def get(self, name: str) -> str:
        """The value under ``name``."""
        values = self._request(f"read {name!r}", lambda client: client.get(self._key(name)))
        if not values:
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in etcd at {self.address}"
            )
        return values[0].decode()

    def delete(self, name: str) -> None:
        """Remove ``name``."""
        if not self._request(f"delete {name!r}", lambda client: client.delete(self._key(name))):
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in etcd at {self.address}"
            )

    def _items(self, prefix: str) -> list[tuple[str, str]]:
        # One range read, a consistent snapshot: [key, key + "0") holds key, key/... and keys
        # such as key-x that only share the string prefix ("0" follows "/"); those are dropped.
        start = self._key(prefix)
        found = self._request(
            f"list {prefix!r}",
            lambda client: client.get(start, metadata=True, range_end=start + b"0"),
        )
        out = []
        for value, meta in found:
            if meta["key"] == start or meta["key"].startswith(start + b"/"):
                out.append((meta["key"][len(self._root) :].decode(), value.decode()))
        return sorted(out)

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under ``prefix``."""
        return [key for key, _ in self._items(prefix)]

    def get_subtree(self, prefix: str) -> list[str]:
        """Values under ``prefix`` (one range read)."""
        return [value for _, value in self._items(prefix)]

    def clear_subtree(self, prefix: str) -> None:
        """Delete ``prefix`` and every key below it in one transaction."""
        start = self._key(prefix)
        txn = {
            "compare": [],
            "failure": [],
            "success": [
                {"request_delete_range": {"key": _b64(start)}},
                {
                    "request_delete_range": {
                        "key": _b64(start + b"/"),
                        "range_end": _b64(start + b"0"),
                    }
                },
            ],
        }
        self._request(f"clear {prefix!r}", lambda client: client.transaction(txn))

    def close(self) -> None:
        """Stop refreshing and revoke the lease: this object's entries are deleted now."""
        self._stop.set()
        with self._lease_lock:
            lease, self._lease = self._lease, None
            self._lease_lost = (
                self._lease_lost or f"{self!r} was closed; make a new registry to add entries"
            )
        if lease is None:
            return
        try:
            self._etcd3gw.Lease(lease.id, self._client()).revoke()
        except self._etcd3gw.exceptions.Etcd3Exception as e:
            logger.warning(
                f"etcd at {self.address}: could not revoke the registry lease ({e}); its entries "
                f"expire within cluster.name_resolve.ttl={self.ttl} s"
            )


def make_repository(config: NameResolveConfig, root: str | os.PathLike) -> NameRepository:
    """The registry ``config`` (``cluster.name_resolve``) names. ``root`` (``name_resolve_root``
    of the run config) is the file registry's directory and the etcd and Ray namespace."""
    if config.type == "file":
        if not str(root):
            raise ValueError("cluster.name_resolve.type=file needs a root directory, got ''")
        return FileNameRepository(root)
    if config.type == "memory":
        return MemoryNameRepository()
    if config.type == "etcd":
        return EtcdNameRepository(
            config.etcd_address, str(root), config.ttl, config.timeout, config.etcd_prefix
        )
    if config.type == "ray":
        return RayNameRepository(config.ray_address, str(root), config.timeout)
    raise ValueError(
        f"cluster.name_resolve.type must be file, memory, etcd or ray; got {config.type!r}"
    )


def trial_key(experiment_name: str, trial_name: str) -> str:
    """Prefix of every key of one trial."""
    return f"{experiment_name}/{trial_name}"


def gen_servers_key(experiment_name: str, trial_name: str) -> str:
    """Prefix under which generation servers of one trial publish ``host:port``."""
    return f"{trial_key(experiment_name, trial_name)}/gen_servers"


def gen_teacher_key(experiment_name: str, trial_name: str) -> str:
    """Prefix under which a trial's distillation teacher servers publish ``host:port``."""
    return f"{trial_key(experiment_name, trial_name)}/teacher_servers"
