"""autotp: one-call tensor parallelism for Hugging Face models, for training.

    model = autotp.wrap(model, tp_size=4)       # under torchrun / accelerate launch
    autotp.save_pretrained(model, "out/")       # full HF checkpoint

Layers, bottom to top; a module imports only from its own layer or the layers below it
(tests/test_layering.py parses every import, those inside functions included, and fails on an
upward import or a cycle):

1. data, no torch.distributed: `hf_compat` (every touch of transformers internals), `sharding`,
   `policy`, `linears`, `plan`, `components`
2. building a plan: `derive`, `twin`, `probe`, `verify`, `planner`, `report`
3. runtime: `groups`, `comm`, `glu`, `layers`, `vocab`, `sequence`, `rng`, `state`, `replicas`,
   `apply`, `rollback`, `lora`
4. files: `io`, `io.errors`, `io.safetensors`, `io.staging`, `io.save`, `io.load`, `io.resume`,
   `adapter_io`
5. entry points: `fsdp`, `guards`, `hf_methods`, `api`, `data_parallel`, `gather`
6. the parity harness: `testing`, `testing.spawn`, `testing.tiny`, `testing.parity`, `testing.memory`
7. tools: `cli`, `hf_trainer`, `__main__`, `__init__` (this package)
"""

from .api import explain, from_pretrained, wrap
from .data_parallel import (
    allreduce_gradients, clip_grad_norm_, data_parallel_sampler, dp_group, dp_rank, dp_size, tp_group, tp_rank,
    tp_size,
)
from .fsdp import dp_mesh, fully_shard
from .gather import GatherReplacedLayerParams
from .groups import finish
from .guards import check_same_inputs
from .io.errors import CheckpointError
from .io.resume import consolidate, load_checkpoint, save_checkpoint
from .io.save import save_pretrained
from .layers import LinearAllreduce, LinearLayer
from .plan import Plan
from .replicas import check_replicas
from .planner import build_plan
from .policy import Origin
from .sharding import Partition, Shard

__all__ = [
    "allreduce_gradients", "check_same_inputs", "clip_grad_norm_", "data_parallel_sampler", "dp_group", "dp_rank",
    "dp_mesh", "dp_size", "finish", "fully_shard", "tp_group", "tp_rank", "tp_size",
    "CheckpointError", "GatherReplacedLayerParams", "LinearAllreduce", "LinearLayer", "Origin", "Partition", "Plan",
    "Shard", "build_plan", "check_replicas", "consolidate", "explain", "from_pretrained", "load_checkpoint", "save_checkpoint",
    "save_pretrained", "wrap",
]
__version__ = "0.1.0"
