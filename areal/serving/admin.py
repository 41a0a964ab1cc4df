"""The admin routes of ``areal serve``: pause and continue generation, give back and take again
the KV cache, set the weight version, and load weights from disk, over a weight-update group or
from tensors a colocated trainer shares (:mod:`areal.utils.weight_sync`). A broadcast that
breaks off (the trainer died, a bucket missed the group's deadline) leaves the old weights in
place and the server serving: the call answers 500 saying so, the server logs it and leaves the
group (the trainer must form a new one). The server's middleware checks the api key of these paths
(:meth:`AdminRoutes.routes`) before they run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch
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
        self.group_timeout = 300.0  # seconds: the group's deadline for every collective
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
            web.post("/update_weights_from_ipc", self.update_from_ipc),
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
        """Drop every entry of the prefix cache (requests running keep their own cache rows):
        ``{"flushed_tokens"}``; nothing to drop when it is off (server.prefix_cache_tokens=0)."""
        n = await asyncio.to_thread(self.generator.flush_cache)
        message = "prefix cache flushed" if self.generator.prefix.on else "no prefix cache (off)"
        return web.json_response({"success": True, "message": message, "flushed_tokens": n})

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
        name = body.get("group_name", weight_sync.GROUP_NAME)
        if not isinstance(name, str) or not name:
            raise BadRequest("group_name", f"expected a non-empty string, got {name!r}")
        await asyncio.to_thread(self._leave_group)
        try:
            self.group = await asyncio.to_thread(
                weight_sync.init_weight_update_group,
                address,
                port,
                offset,
                world,
                backend,
                float(timeout),
                name,
            )
            self.group_timeout = float(timeout)
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
        try:
            named = await asyncio.to_thread(
                weight_sync.receive_weights,
                specs,
                self.group,
                bucket_bytes,
                self.generator.model.device,
                self.group_timeout,
            )
        except (dist.DistError, RuntimeError) as e:  # the trainer died or a bucket came late
            return await self._broken_off(e)
        try:
            v = await asyncio.to_thread(
                self.generator.update_weights, named, self._version_arg(body)
            )
        except ValueError as e:  # NaN/inf or wrong tensors: the old weights stay
            raise BadRequest("names", str(e)) from None
        return web.json_response({"success": True, "message": "updated", "weight_version": v})

    def _leave_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                weight_sync.destroy_weight_update_group(group)
            except (RuntimeError, ValueError) as e:  # a broken group may not come down cleanly
                logger.warning("leaving the weight update group: %s", e)

    async def _broken_off(self, e: BaseException) -> web.Response:
        """A broadcast that broke off: old weights kept, group left, 500 naming the cause."""
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        version = self.generator.version
        msg = (
            f"weight update over the group broke off ({cause}); the server keeps serving the old "
            f"weights (version {version}) and left the group: form it again with "
            "/init_weights_update_group"
        )
        logger.error(msg)
        await asyncio.to_thread(self._leave_group)
        return web.json_response(error_body(500, msg), status=500)

    async def update_from_ipc(self, request: web.Request) -> web.Response:
        """Copy in the tensors a trainer on this machine (and GPU) shares:
        a :meth:`weight_sync.SharedBuffer.payload` and ``"weight_version"``, optional."""
        body = await self._body(request)
        try:
            shared = await asyncio.to_thread(weight_sync.open_shared, body)
            v = await asyncio.to_thread(
                self.generator.update_weights, dict(shared), self._version_arg(body)
            )
            device = torch.device(self.generator.model.device)
            if device.type == "cuda":  # copied before the trainer may free its buffer
                await asyncio.to_thread(torch.cuda.synchronize, device)
        except ValueError as e:  # a bad payload, a GPU not here, NaN/inf: the old weights stay
            field = str(e).split(":")[0]
            field = field if field in ("devices", "offsets", "dtypes", "shapes") else "handles"
            raise BadRequest(field, str(e)) from None
        finally:
            shared = None  # the views of the trainer's memory go before the answer
        return web.json_response({"success": True, "message": "updated", "weight_version": v})
