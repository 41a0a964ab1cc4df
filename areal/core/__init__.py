"""Core mode: a master runs a dataflow graph (DFG) of model function calls (MFCs) over model workers.

What exists (docs/core.md): the graph as checked data (:mod:`areal.core.dfg`) and the graphs of
sync PPO, async PPO and SFT (:mod:`areal.core.graphs`), printed by ``areal core graph``.
"""
