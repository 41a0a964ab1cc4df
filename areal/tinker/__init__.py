"""A Tinker-compatible training service (``areal tinker serve``): the ``tinker`` SDK and
tinker-cookbook recipes run against our trainer and generator (docs/tinker.md)."""
