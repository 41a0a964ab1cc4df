"""Core mode: a master runs a dataflow graph (DFG) of model function calls (MFCs) over model workers.

What exists (docs/core.md): the graph as checked data (:mod:`areal.core.dfg`) and the graphs of
sync PPO, async PPO and SFT (:mod:`areal.core.graphs`), printed by ``areal core graph``; the
master's metadata buffer (:mod:`areal.core.buffer`) and scheduler (:mod:`areal.core.master`);
the model-worker interface, an in-process worker hosting Lite engines (:mod:`areal.core.worker`)
and workers as Ray actors (:mod:`areal.core.ray_worker`); Core SFT through the master
(:mod:`areal.core.sft`, ``areal core sft``); parameter reallocation as an MFC hook. Generation
on workers and tensor parallelism are not built.
"""
