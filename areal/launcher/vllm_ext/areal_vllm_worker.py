"""A vLLM worker extension (``--worker-extension-cls areal_vllm_worker.WeightReload``): the
weight updates the rollout client calls through ``POST /collective_rpc``: from disk
(``areal_reload_weights``) and over the trainer's broadcast group (``areal_init_weight_group``,
``areal_update_weights_from_distributed``).

Runs in vLLM's worker processes only, in vLLM's own venv: it imports the standard library, torch
(vLLM's) and areal/utils/weight_sync.py, loaded by its path in this checkout (that file imports
torch and the standard library only), so the vLLM worker joins the trainer's group and receives
its byte buckets with the very code our own server runs. vLLM mixes the class into its worker
class, so ``self`` is the worker.

Why not vLLM's own ``reload_weights`` alone: in vLLM 0.32 it reloads and re-processes each layer
whose weights it is given. A model with tied word embeddings (Qwen2/2.5/3 small sizes, our tiny
model) has no LM-head weight in its checkpoint, so the head is put back as it was
("ParallelLMHead: Failed to load weights" in the server log) with what was derived from the old
weights at load time (on CPU, the GEMM prepared by ``process_weights_after_loading``): the
served model then has the new body and the old head. Checked against a transformers forward
(tests/rollout/test_vllm_real.py). :meth:`WeightReload._areal_reload` reloads, ties the head to
the new embedding again and re-runs the head's weight processing.

Why not vLLM's weight-transfer engines (``--weight-transfer-config``): they form NCCL groups of
their own (no gloo, so nothing on CPU) and a layout of their own, while the trainer sends one
protocol to every server kind.
"""

import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("areal_vllm_worker")
WEIGHT_SYNC = Path(__file__).resolve().parents[2] / "utils" / "weight_sync.py"


def _weight_sync() -> Any:
    """areal/utils/weight_sync.py as module ``areal_weight_sync`` (loaded once)."""
    if "areal_weight_sync" not in sys.modules:
        spec = importlib.util.spec_from_file_location("areal_weight_sync", WEIGHT_SYNC)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot load {WEIGHT_SYNC}; keep areal_vllm_worker in its checkout")
        module = importlib.util.module_from_spec(spec)
        sys.modules["areal_weight_sync"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["areal_weight_sync"]


class WeightReload:
    """Worker methods called by name through vLLM's ``/collective_rpc``."""

    # what the methods use of vLLM's worker class they are mixed into: annotations only, which
    # create no class attribute that could shadow the worker's own
    reload_weights: Any
    model_runner: Any
    vllm_config: Any

    def areal_reload_weights(self, weights_path: str) -> None:
        """Load the HF safetensors under ``weights_path`` in place; re-tie a tied LM head."""
        self._areal_reload(weights_path=weights_path)

    def areal_init_weight_group(self, spec: str) -> None:
        """Join the trainer's group: ``spec`` is the JSON of our server's
        ``/init_weights_update_group`` body (``master_address``, ``master_port``,
        ``rank_offset``, ``world_size``, ``group_name``, ``backend``, ``timeout``)."""
        if self.vllm_config.parallel_config.world_size != 1:
            raise RuntimeError(
                "weight_update_mode=distributed reaches a vLLM server of one worker only "
                f"(this one has {self.vllm_config.parallel_config.world_size}); use disk updates"
            )
        body = json.loads(spec)
        ws = _weight_sync()
        self._areal_leave()
        self._areal_group = ws.init_weight_update_group(
            body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
            int(body["world_size"]), body["backend"], float(body["timeout"]), body["group_name"],
        )  # fmt: skip
        self._areal_group_timeout = float(body["timeout"])

    def areal_update_weights_from_distributed(self, spec: str) -> None:
        """Receive the announced tensors (``spec``: JSON ``{"names", "dtypes", "shapes",
        "bucket_bytes"}``) in the trainer's byte buckets, then load them all. A broadcast that
        breaks off leaves the old weights loaded; the worker logs it and leaves the group."""
        group = getattr(self, "_areal_group", None)
        if group is None:
            raise RuntimeError("no weight update group; call areal_init_weight_group first")
        body = json.loads(spec)
        ws = _weight_sync()
        specs = ws.specs_from_announcement(body["names"], body["dtypes"], body["shapes"])
        try:
            named = ws.receive_weights(
                specs, group, int(body["bucket_bytes"]), self.model_runner.device,
                self._areal_group_timeout,
            )  # fmt: skip
        except RuntimeError as e:  # the trainer died or a bucket came late: nothing was loaded
            msg = (
                f"weight update over the group broke off ({str(e).strip()[:300]}); vLLM keeps "
                "serving the old weights and left the group: form it again"
            )
            logger.error(msg)
            self._areal_leave()
            raise RuntimeError(msg) from None
        self._areal_reload(weights_iterator=iter(list(named.items())))

    def _areal_leave(self) -> None:
        group, self._areal_group = getattr(self, "_areal_group", None), None
        if group is not None:
            try:
                _weight_sync().destroy_weight_update_group(group)
            except (RuntimeError, ValueError) as e:  # a broken group may not come down cleanly
                logger.warning("leaving the weight update group: %s", e)

    def _areal_reload(self, **source: Any) -> None:
        """vLLM's ``reload_weights(**source)``, then the tied LM head bound to the new embedding
        and its weight processing re-run (see the module docstring)."""
        self.reload_weights(**source)
        runner = self.model_runner
        if not getattr(runner.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        model = runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            raise RuntimeError(
                f"{type(model).__name__} ties its word embeddings but has no lm_head / "
                "model.embed_tokens to tie again after a reload; this extension knows the "
                "Llama/Qwen layout only"
            )
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
