"""The ``etcd`` name registry: keys in an etcd v3 server through its JSON gateway, each process's
entries on a lease it keeps alive, so a dead process's entries expire (see
:mod:`areal.utils.name_resolve`)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from typing import TypeVar

import etcd3gw  # loaded only when cluster.name_resolve.type=etcd (make_repository)
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

from areal.utils.logging import get_logger
from areal.utils.name_resolve import (
    NameEntryExistsError,
    NameEntryNotFoundError,
    NameRepository,
    RegistryUnavailableError,
    clean_key,
)

logger = get_logger("name_resolve")
T = TypeVar("T")


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
        host, _, port = address.rpartition(":")
        if not (host and port.isdigit()):
            raise ValueError(
                f"cluster.name_resolve.etcd_address must be host:port, got {address!r}"
            )
        self.address, self.ttl, self.timeout = address, ttl, timeout
        self._host, self._port = host, int(port)
        self._root = (
            "/".join(p for p in (prefix.strip("/"), namespace.strip("/")) if p) + "/"
        ).encode()
        self._local = threading.local()
        self._lease_lock = threading.Lock()
        self._lease: etcd3gw.Lease | None = None  # granted by the first add
        self._lease_lost = ""  # why this process's entries are gone, set by the keep-alive thread
        self._stop = threading.Event()
        self._request("answer a status request", lambda client: client.status())

    def _key(self, name: str) -> bytes:
        return self._root + clean_key(name).encode()

    def _client(self) -> Etcd3Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = etcd3gw.client(
                host=self._host, port=self._port, timeout=self.timeout, api_path="/v3/"
            )
            self._local.client = client
        return client

    def _request(self, what: str, call: Callable[[Etcd3Client], T]) -> T:
        try:
            return call(self._client())
        except Etcd3Exception as e:
            raise RegistryUnavailableError(
                f"etcd at {self.address} (cluster.name_resolve.etcd_address) did not {what}: "
                f"{type(e).__name__}: {e} {e.detail_text or ''}; start etcd there or point "
                "cluster.name_resolve.etcd_address at a running one (etcd >= 3.4, whose /health "
                "answers)"
            ) from e

    def _owned_lease(self) -> etcd3gw.Lease:
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
                remaining = etcd3gw.Lease(lease_id, self._client()).refresh()
            except Etcd3Exception as e:
                logger.warning(
                    f"etcd at {self.address}: lease refresh failed ({e}); retrying in {period:.1f} "
                    "s"
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
                f"registry key {clean_key(name)!r} is already set in etcd at {self.address}; pass "
                "replace=True to overwrite it"
            )

    def get(self, name: str) -> str:
        """The value under ``name``."""
        values = self._request(f"read {name!r}", lambda client: client.get(self._key(name)))
        if not values:
            raise NameEntryNotFoundError(
                f"registry key {clean_key(name)!r} is not set in etcd at {self.address}"
            )
        return values[0].decode()

    def delete(self, name: str) -> None:
        """Remove ``name``."""
        if not self._request(f"delete {name!r}", lambda client: client.delete(self._key(name))):
            raise NameEntryNotFoundError(
                f"registry key {clean_key(name)!r} is not set in etcd at {self.address}"
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
            etcd3gw.Lease(lease.id, self._client()).revoke()
        except Etcd3Exception as e:
            logger.warning(
                f"etcd at {self.address}: could not revoke the registry lease ({e}); its entries "
                f"expire within cluster.name_resolve.ttl={self.ttl} s"
            )
