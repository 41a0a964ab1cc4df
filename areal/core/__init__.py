"""Core mode: a master runs a dataflow graph (DFG) of model function calls (MFCs) over workers.

What exists (docs/core.md): the graph as checked data placed on workers (:mod:`areal.core.dfg`,
over the MFCs of :mod:`areal.api.mfc`) and the graphs of sync PPO, async PPO and SFT
(:mod:`areal.core.graphs`, over the steps Lite runs in process, :mod:`areal.runtime.graphs`),
printed by ``areal core graph``; the
master's metadata buffer (:mod:`areal.core.buffer`) and scheduler (:mod:`areal.core.master`);
the model-worker interface, an in-process worker hosting Lite engines (:mod:`areal.core.worker`)
and workers as Ray actors on disjoint dp x tp sub-meshes (:mod:`areal.core.ray_worker`);
parameter reallocation and server weight updates as MFC hooks; a generation worker running
Lite's rollout side (:mod:`areal.core.generation`); the entry points ``areal core sft``
(:mod:`areal.core.sft`), ``areal core sync-ppo`` (:mod:`areal.core.sync_ppo`) and ``areal core
async-ppo`` (:mod:`areal.core.async_ppo`: rollout workers admitted by one generation manager,
:mod:`areal.core.manager`, :mod:`areal.core.rollout_worker`, :mod:`areal.core.rollout_side`),
whose shared session helpers live in :mod:`areal.core.session`. Where Core stands in for a Lite
class it fills the same seam of :mod:`areal.api.protocols`.
"""
