"""The offloading engine that both front-ends (:mod:`cpu_offload.v1`, :mod:`cpu_offload.v2`)
drive, one module per role:

* :mod:`~cpu_offload.engine.selection`: which saved tensors are offloaded (marks,
  policies, and whether a memory layout can be copied whole);
* :mod:`~cpu_offload.engine.tensor_group`: one layer's saved tensors reduced to the
  blocks that are copied, and rebuilt after the reload;
* :mod:`~cpu_offload.engine.layout`: the size, strides and dtype of a copied block;
* :mod:`~cpu_offload.engine.transport`: streams, events and pinned host buffers that
  move the bytes (CUDA, or the CPU stand-in);
* :mod:`~cpu_offload.engine.layer_state`: one layer's tensors and the state machine
  that moves them;
* :mod:`~cpu_offload.engine.reload_order`: the order of a layer's copies back, and
  when its backward may start beside them;
* :mod:`~cpu_offload.engine.active`: which offload contexts are active, per thread;
* :mod:`~cpu_offload.engine.context`: the ``with`` block both front-ends' contexts share.

The front-ends decide *when* layers move (V2's synchronizers and schedules, V1's
handlers); the engine decides *what* moves and *how*.
"""
