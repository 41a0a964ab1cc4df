"""A vLLM worker extension (``--worker-extension-cls areal_vllm_worker.WeightReload``): the
disk weight update the rollout client calls through ``POST /collective_rpc``.

Runs in vLLM's worker processes only, and imports nothing outside the standard library: vLLM
mixes the class into its worker class, so ``self`` is the worker.

Why not vLLM's own ``reload_weights``: in vLLM 0.32 it reloads and re-processes each layer
whose weights the checkpoint holds. A model with tied word embeddings (Qwen2/2.5/3 small sizes,
our tiny model) has no LM-head weight in its checkpoint, so the head is put back as it was
("ParallelLMHead: Failed to load weights" in the server log) with what was derived from the old
weights at load time (on CPU, the GEMM prepared by ``process_weights_after_loading``): the
served model then has the new body and the old head. Checked against a transformers forward
(tests/rollout/test_vllm_real.py). This method reloads, ties the head to the new embedding
again and re-runs the head's weight processing.
"""

from typing import Any


class WeightReload:
    """Worker methods called by name through vLLM's ``/collective_rpc``."""

    # what the methods use of vLLM's worker class they are mixed into: annotations only, which
    # create no class attribute that could shadow the worker's own
    reload_weights: Any
    model_runner: Any

    def areal_reload_weights(self, weights_path: str) -> None:
        """Load the HF safetensors under ``weights_path`` in place; re-tie a tied LM head."""
        self.reload_weights(weights_path=weights_path)
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
