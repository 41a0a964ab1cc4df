"""The rollout client side, run inside each trainer process: the HTTP inference engine
(``remote``, ``backends``), the workflow executor with staleness admission (``executor``,
``staleness``) and trajectory batching (``trajectory``)."""
