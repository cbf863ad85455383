"""Cluster planning (issue 6): per-primitive performance models, MoNTA's chunk search and strategy
select, a memory model, an event simulation of a step's MoE layers and the layout search behind
``interlace plan``. Nothing here touches a GPU; it runs in seconds on a laptop CPU.

Modules: ``primitives`` (link classes, efficiency curves, per-primitive time), ``cluster`` (cluster
descriptions and presets), ``monta`` (MoNTA Algorithms 1–3, Eqs. 8–16), ``memory`` (MoNTA Tables
3–4 plus interlace's buffers), ``layer`` (TP×EP all-to-all forms O0–O3 as op lists,
:func:`predict_layer_ms`), ``simulate`` (event simulation, PNG timeline), ``search``
(enumerate + rank), ``cli`` (``interlace plan``).
"""
