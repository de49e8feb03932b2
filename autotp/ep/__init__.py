"""Expert parallelism: each MoE layer's routed experts split by expert over the mesh's EP axis, tokens sent to them.

`regions` finds the experts modules (or refuses one by name), `groups` reads the folded expert grid from the mesh,
`collectives` holds the all-to-all and TP row pairs, `dispatch` the experts module's new forward, `grads` the expert
gradients' sum over expert-DP, `gathered` the refusal of a backward inside `GatherReplacedLayerParams`, `modality` the
experts modules a block runs only for some batches (each run on every EP rank), `apply` its `autotp.parallelize` step.
It imports the mesh, the state, the runtime and planning; no other dimension.
"""
