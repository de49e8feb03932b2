"""autotp: one-call tensor parallelism for Hugging Face models, for training.

    model = autotp.wrap(model, tp_size=4)       # under torchrun / accelerate launch
    autotp.save_pretrained(model, "out/")       # full HF checkpoint
"""

from .api import explain, wrap
from .checkpoint import save_pretrained
from .data_parallel import (
    allreduce_gradients, check_same_inputs, clip_grad_norm_, data_parallel_sampler, dp_group, dp_rank, dp_size,
    tp_group, tp_rank, tp_size,
)
from .gather import GatherReplacedLayerParams
from .layers import LinearAllreduce, LinearLayer
from .loading import CheckpointError, from_pretrained
from .plan import Plan, build_plan
from .resume import consolidate, load_checkpoint, save_checkpoint
from .sharding import Partition, Shard

__all__ = [
    "allreduce_gradients", "check_same_inputs", "clip_grad_norm_", "data_parallel_sampler", "dp_group", "dp_rank",
    "dp_size", "tp_group", "tp_rank", "tp_size",
    "CheckpointError", "GatherReplacedLayerParams", "LinearAllreduce", "LinearLayer", "Partition", "Plan", "Shard",
    "build_plan", "consolidate", "explain", "from_pretrained", "load_checkpoint", "save_checkpoint", "save_pretrained",
    "wrap",
]
__version__ = "0.1.0"
