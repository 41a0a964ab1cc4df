"""Code that runs inside vLLM's processes, not areal's: this directory goes on the vLLM server's
PYTHONPATH (areal/launcher/servers.py) so its Python, in a venv of its own, imports
:mod:`areal_vllm_worker` by that top-level name without importing areal or its dependencies."""
