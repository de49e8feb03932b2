"""autotp: one-call tensor parallelism for Hugging Face models, for training.

    model = autotp.wrap(model, tp_size=4)       # under torchrun / accelerate launch
    autotp.save_pretrained(model, "out/")       # full HF checkpoint
"""

from .api import explain, wrap
from .checkpoint import save_pretrained
from .gather import GatherReplacedLayerParams
from .layers import LinearAllreduce, LinearLayer
from .loading import CheckpointError, from_pretrained
from .plan import Plan, build_plan
from .resume import consolidate, load_checkpoint, save_checkpoint
from .sharding import Partition, Shard

__all__ = [
    "CheckpointError", "GatherReplacedLayerParams", "LinearAllreduce", "LinearLayer", "Partition", "Plan", "Shard",
    "build_plan", "consolidate", "explain", "from_pretrained", "load_checkpoint", "save_checkpoint", "save_pretrained",
    "wrap",
]
__version__ = "0.1.0"
