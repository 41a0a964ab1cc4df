"""Config of the embedded generation server (``areal serve``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterator, Literal

from areal.api.config.loader import param

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for 0.0.0.0 and real interfaces."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class GenerationServerConfig:
    """An HTTP server speaking SGLang's native API plus OpenAI completions/chat."""

    model_path: str = param(
        "", help="Hugging Face model dir (config, safetensors, tokenizer); required by `areal serve` "
        "(the launcher passes the actor's path)."
    )
    served_model_name: str = param("", help="Name reported by /v1/models; empty = model_path.")
    host: str = param("127.0.0.1", help="Bind address; a non-loopback bind requires api_key.")
    port: int = param(30000, ge=0, le=65535, help="TCP port; 0 picks a free one (printed).")
    api_key: str = param(
        "", secret=True,
        help="Bearer key for admin endpoints (weight updates, pause, flush); empty = none. Prefer "
        "the AREAL_SERVER_API_KEY env variable (read when this is empty): a key on a command "
        "line is visible to every user of the machine. Never written to RUN_DIR.",
    )
    device: str = param("cpu", help="torch device: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = param(
        "float32", help="Weight and KV-cache dtype (fp32 on CPU)."
    )
    max_batch_size: int = param(32, ge=1, help="Most requests decoded together (cache slots).")
    max_n: int = param(
        256, ge=1, help="Most completions one HTTP request may ask for (prompts x n); more gets "
        "HTTP 400 naming n."
    )
    context_length: int = param(
        0, ge=0, help="Max prompt + completion tokens; 0 = the model's max_position_embeddings."
    )
    max_prefill_tokens: int = param(
        8192, ge=1, help="Prompt-token budget admitted into one step (the first prompt always fits)."
    )
    share_prompts: bool = param(
        True, help="Requests admitted in one step with the same prompt (a group's samples) prefill "
        "it once and copy its cache rows; false = one prefill per request (same outputs, slower)."
    )
    cpu_attention: Literal["auto", "compiled", "torch"] = param(
        "auto",
        help="Decode attention on CPU fp32: compiled = a C kernel built with $CC (default cc) at "
        "start, an error if it cannot be built; torch = batched matmuls; auto = compiled if it "
        "builds, else torch with a warning. /get_server_info reports decode_attention.",
    )
    seed: int = param(0, ge=0, help="Seed of the shared generator for requests without a seed.")
    weight_version: int = param(
        0, ge=0, help="Version stamped on tokens until the first weight update (a restarted "
        "server passes the version of the weights it loads)."
    )
    shutdown_timeout: float = param(
        10.0, gt=0, help="Seconds to finish answering in-flight requests on SIGTERM."
    )
    log_level: Literal["debug", "info", "warning", "error"] = param("info", help="Log level.")

    def check(self) -> Iterator[str]:
        if not is_loopback(self.host) and not self.api_key:
            yield (
                f"api_key: binding non-loopback host {self.host!r} needs an API key for the "
                "admin endpoints; pass --api-key KEY or bind 127.0.0.1"
            )
        if self.dtype != "float32" and self.device == "cpu":
            yield f"dtype: {self.dtype} on CPU is slow and inexact; use float32 on CPU"
