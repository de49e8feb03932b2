"""Pipeline parallelism: the decoder layers cut into stages, one group of ranks each, trained through
torch.distributed.pipelining's schedules (`autotp.forward_backward` runs a step at every layout).

It imports the runtime, the mesh and the state; no other dimension.
"""
