"""The admin routes of ``areal serve``: pause and continue generation, give back and take again
the KV cache, set the weight version, and load weights from disk or over a weight-update group
(:mod:`areal.utils.weight_sync`). The server's middleware checks the api key of these paths
(:meth:`AdminRoutes.routes`) before they run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch.distributed as dist
from aiohttp import web

from areal.serving.generator import Generator
from areal.serving.protocol import error_body
from areal.serving.requests import BadRequest
from areal.utils import weight_sync

logger = logging.getLogger("areal.serve")


def _bounded_int(body: dict, key: str, lo: int, hi: int) -> int:
    """``body[key]``, an integer in [lo, hi]; BadRequest naming ``key`` otherwise."""
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(key, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


class AdminRoutes:
    """The admin endpoints over one :class:`Generator`; ``read_json`` reads a request's JSON
    body within the server's limits."""

    def __init__(
        self,
        generator: Generator,
        read_json: Callable[[web.Request], Awaitable[object]],
        weight_read_timeout: float = 600.0,
    ):
        self.generator = generator
        self.read_json = read_json
        self.weight_read_timeout = weight_read_timeout  # seconds (server.weight_read_timeout)
        self.group: dist.ProcessGroup | None = None  # joined via /init_weights_update_group
        self.control = asyncio.Lock()  # pause and continue take effect in the order they arrive
        self.loading = asyncio.Lock()  # one disk update reads at a time: one copy in memory

    def routes(self) -> list[web.RouteDef]:
        """The admin paths (SGLang's names) and their handlers."""
        return [
            web.post("/pause_generation", self.pause),
            web.post("/continue_generation", self.resume),
            web.post("/flush_cache", self.flush_cache),
            web.post("/release_memory_occupation", self.release_memory),
            web.post("/resume_memory_occupation", self.resume_memory),
            web.post("/update_weight_version", self.update_version),
            web.post("/update_weights_from_disk", self.update_from_disk),
            web.post("/init_weights_update_group", self.init_group),
            web.post("/update_weights_from_distributed", self.update_from_distributed),
        ]

    async def _body(self, request: web.Request) -> dict:
        """The JSON object of an admin request ({} without a body); 400 for anything else."""
        if not request.body_exists:  # (read already: can_read_body is False now)
            return {}
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("body", "expected a JSON object")
        return body

    @staticmethod
    def _version_arg(body: dict, key: str = "weight_version") -> int | None:
        """An optional weight version of the body: an integer in [0, 2**63)."""
        return None if body.get(key) is None else _bounded_int(body, key, 0, (1 << 63) - 1)

    async def pause(self, request: web.Request) -> web.Response:
        """Abort in-flight requests (answered with partials) and hold new ones."""
        async with self.control:
            n = await asyncio.to_thread(self.generator.pause)
        return web.json_response({"success": True, "num_aborted_requests": n})

    async def resume(self, request: web.Request) -> web.Response:
        """Accept work again (after any pause that arrived before this)."""
        async with self.control:
            await asyncio.to_thread(self.generator.resume)
        return web.json_response({"success": True})

    async def release_memory(self, request: web.Request) -> web.Response:
        """Give back the KV cache while paused, so a colocated trainer can step on the GPU:
        ``{"freed_bytes"}``; 400 when not paused. The weights stay loaded."""
        try:
            freed = await asyncio.to_thread(self.generator.release_memory)
        except ValueError as e:  # not paused: nothing is given back
            return web.json_response(error_body(400, str(e)), status=400)
        logger.info("released the KV cache (%d bytes) until /resume_memory_occupation", freed)
        return web.json_response({"success": True, "freed_bytes": freed})

    async def resume_memory(self, request: web.Request) -> web.Response:
        """Allocate the KV cache again (after ``/release_memory_occupation``)."""
        await asyncio.to_thread(self.generator.resume_memory)
        return web.json_response({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache is kept between requests, so there is nothing to flush."""
        return web.json_response({"success": True, "message": "no prefix cache to flush"})

    async def update_version(self, request: web.Request) -> web.Response:
        """Set the version stamped on new tokens: ``{"new_version": int}``."""
        version = self._version_arg(await self._body(request), "new_version")
        if version is None:
            raise BadRequest("new_version", "missing")
        await asyncio.to_thread(self.generator.set_version, version)
        return web.json_response({"success": True, "weight_version": version})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """Load weights from an HF dir: ``{"model_path", "weight_version"?}``. The files are read
        on a worker thread, only regular ones, within ``server.weight_read_timeout``."""
        body = await self._body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path", f"expected a Hugging Face model dir, got {path!r}")
        try:
            async with self.loading:
                v = await asyncio.to_thread(
                    self.generator.update_weights_from_disk,
                    path,
                    self._version_arg(body),
                    self.weight_read_timeout,
                )
        except ValueError as e:  # not a regular file, unreadable, partial or non-finite
            raise BadRequest("model_path", str(e)) from None
        return web.json_response({"success": True, "message": "loaded", "weight_version": v})

    async def init_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-update group (see :mod:`areal.utils.weight_sync`)."""
        body = await self._body(request)
        address = body.get("master_address")
        if not isinstance(address, str) or not address:
            raise BadRequest("master_address", f"expected a host name or IP, got {address!r}")
        port = _bounded_int(body, "master_port", 1, 65535)
        world = _bounded_int(body, "world_size", 2, 1 << 16)
        offset = _bounded_int(body, "rank_offset", 1, world - 1)
        timeout = body.get("timeout", 300.0)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= 86400
        ):
            raise BadRequest("timeout", f"expected seconds in (0, 86400], got {timeout!r}")
        backend = body.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise BadRequest("backend", f"expected 'gloo' or 'nccl', got {backend!r}")
        try:
            self.group = await asyncio.to_thread(
                weight_sync.init_weight_update_group,
                address,
                port,
                offset,
                world,
                backend,
                float(timeout),
            )
        except (dist.DistError, OSError) as e:  # nobody listens there, or rank 0 never came
            cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise BadRequest(
                "master_address",
                f"cannot join the weight update group at {address}:{port} within {timeout} s "
                f"(timeout): {cause}; start the trainer's side first (rank 0 listens there) or "
                "fix master_address/master_port",
            ) from None
        return web.json_response({"success": True, "message": "joined weight update group"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """Receive announced tensors over the group, then swap them in between steps."""
        body = await self._body(request)
        if self.group is None:
            raise BadRequest(
                "group_name", "no weight update group; call /init_weights_update_group"
            )
        try:
            specs = weight_sync.specs_from_announcement(
                body.get("names"), body.get("dtypes"), body.get("shapes")
            )
        except ValueError as e:
            raise BadRequest(str(e).split(":")[0], str(e)) from None
        bucket_bytes = body.get("bucket_bytes", 256 << 20)
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise BadRequest("bucket_bytes", f"expected a positive integer, got {bucket_bytes!r}")
        named = await asyncio.to_thread(
            weight_sync.receive_weights,
            specs,
            self.group,
            bucket_bytes,
            self.generator.model.device,
        )
        try:
            v = await asyncio.to_thread(
                self.generator.update_weights, named, self._version_arg(body)
            )
        except ValueError as e:  # NaN/inf or wrong tensors: the old weights stay
            raise BadRequest("names", str(e)) from None
        return web.json_response({"success": True, "message": "updated", "weight_version": v})
