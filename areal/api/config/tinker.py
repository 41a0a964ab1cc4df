"""Config of the Tinker-compatible training service (``areal tinker serve``; docs/tinker.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param
from areal.utils.http_guard import is_loopback


@dataclass(frozen=True)
class TinkerConfig:
    """An HTTP service speaking the Tinker API (the ``tinker`` SDK's routes and payloads),
    backed by one FSDP trainer rank in the service process and the embedded generator."""

    model: str = param(
        "", help="Hugging Face model dir the service trains and samples; required (--model)."
    )
    model_name: str = param(
        "",
        help="Base-model name clients pass to create_lora_training_client / "
        "create_sampling_client (e.g. Qwen/Qwen3-8B, so a script runs unchanged); empty = the "
        "model dir as given. The dir itself is accepted too.",
    )
    host: str = param("127.0.0.1", help="Bind address.")
    port: int = param(8000, ge=0, le=65535, help="TCP port; 0 picks a free one (printed).")
    api_keys: list[str] = param(
        [],
        secret=True,
        help="API keys the service accepts (the SDK sends TINKER_API_KEY as X-API-Key; keys "
        "start with tml-). Each key owns its sessions, models and checkpoints; another key's "
        "model ids get HTTP 403. Empty = any tml- key, each one isolated (loopback binds only). "
        "Never written to disk.",
    )
    root: str = param(
        "runs/tinker",
        help="Directory of training runs and checkpoints: ROOT/<model_id>/weights/<name> "
        "(save_state) and sampler_weights/<name> (HF exports); tinker:// paths resolve here.",
    )
    max_batch_tokens: int = param(
        32768,
        ge=1,
        help="Most tokens one forward_backward / forward request may carry over its datums; "
        "more gets HTTP 400 naming the field.",
    )
    max_lora_rank: int = param(128, ge=1, help="Largest LoRA rank a client may ask for.")
    lora_alpha: float = param(
        32.0, gt=0, help="LoRA alpha of every training model: the update is (alpha / rank) B A."
    )
    dtype: Literal["float32", "bfloat16"] = param(
        "float32", help="Weight dtype of the trainer and the generator (fp32 on CPU)."
    )
    device: str = param(
        "cpu",
        help="torch device of the generator: cpu, cuda, cuda:1, ...; the trainer rank runs on "
        "the CPU (gloo) with cpu, else on the first GPU (NCCL).",
    )
    max_tokens_per_mb: int = param(
        8192, ge=1, help="Token budget of one trainer micro-batch (forward_backward splits by it)."
    )
    max_batch_size: int = param(32, ge=1, help="Generator cache slots (requests decoded together).")
    max_sample_tokens: int = param(
        4096,
        ge=1,
        help="max_tokens of a sample request that leaves it unset; larger values are capped by "
        "the model's context.",
    )
    wait_s: float = param(
        20.0,
        gt=0,
        help="Seconds a retrieve_future call holds the connection waiting for its result "
        "before answering try_again (the SDK then asks again).",
    )

    def check(self) -> Iterator[str]:
        if not self.api_keys and not is_loopback(self.host):
            yield (
                f"api_keys: empty with host={self.host!r}; a service reachable from other "
                "machines must list its keys (api_keys=[tml-...])"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            yield f"device: {self.device!r} is not cpu or cuda[:N]"
        bad = [k for k in self.api_keys if not k.startswith("tml-")]
        if bad:
            yield f"api_keys: {len(bad)} key(s) without the tml- prefix the tinker SDK requires"
