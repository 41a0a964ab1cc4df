"""areal: asynchronous RL for LLM post-training on verifiable tasks."""

__version__ = "0.1.0"
