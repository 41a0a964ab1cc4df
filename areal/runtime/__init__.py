"""The run context of a trainer process: the distributed context (process group, device mesh),
seeds, timers, stats, recover checkpoints (``run``) and the weight publisher (``publisher``)."""
