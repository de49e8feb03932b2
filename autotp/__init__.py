"""autotp: one-call tensor parallelism for Hugging Face models, for training.

    model = autotp.wrap(model, tp_size=4)       # under torchrun / accelerate launch
    autotp.save_pretrained(model, "out/")       # full HF checkpoint

Layers, bottom to top; a module imports only from its own layer or the layers below it
(tests/test_layering.py parses every import, those inside functions included, and fails on an
upward import or a cycle). Each folder is one tier; its `__init__` says what it is for.

1. dependency boundaries: `compat`, `compat.versions`, `compat.peft`, `compat.torch`, `compat.trainer`,
   `compat.hf`, `compat.hf_conversion`
2. plan data, no torch.distributed: `planning`, `planning.options`, `planning.sharding`, `planning.policy`,
   `planning.linears`, `planning.plan`, `planning.components`
3. building a plan: `planning.derive`, `planning.twin`, `planning.probe`, `planning.verify`,
   `planning.planner`, `planning.report`
4. the parallel runtime: `parallel`, `parallel.dtensor_rows`, `parallel.groups`,
   `parallel.collectives`, `parallel.seq_collectives`, `parallel.overlap`, `parallel.grad_hooks`,
   `parallel.glu`, `parallel.block_entry`, `parallel.layers`, `parallel.vocab`, `parallel.heads`, `parallel.sequence`,
   `parallel.rng`, `parallel.state`, `parallel.state_dict`, `parallel.replicas`, `parallel.agreement`,
   `parallel.apply`, `parallel.rollback`, `parallel.lora`, `parallel.lora_lift`, `parallel.row_gather`,
   `parallel.input_agreement`, `parallel.context_attention`, `parallel.context_dropout`, `parallel.context_kernels`,
   `parallel.context_loss`, `parallel.context`
5. files: `io`, `io.errors`, `io.streaming`, `io.safetensors`, `io.staging`, `io.save`, `io.load`, `io.rng_state`,
   `io.chunks`, `io.checkpoint`, `io.legacy`, `io.legacy_optimizer`, `io.restore`, `io.consolidate`, `io.adapters`,
   `io.parts`, `io.export`, `io.sync`
6. entry points: `fsdp`, `guards`, `hf_methods`, `parallelize`, `api`, `data_parallel`, `gather`
7. the parity harness: `testing`, `testing.spawn`, `testing.tiny`, `testing.parity`, `testing.memory`,
   `testing.varlen`
8. tools: `cli`, `hf_trainer`, `hf_trl`, `__main__`, `__init__` (this package)
"""

from .api import explain, from_pretrained, wrap
from .data_parallel import (
    allreduce_gradients, clip_grad_norm_, cp_group, cp_rank, cp_size, data_parallel_sampler, dp_cp_group, dp_group,
    dp_rank, dp_size, tp_group, tp_rank, tp_size,
)
from .fsdp import dp_mesh, fully_shard
from .gather import GatherReplacedLayerParams
from .parallel.groups import finish
from .guards import check_same_inputs
from .io.errors import CheckpointError
from .io.checkpoint import save_checkpoint
from .io.consolidate import consolidate
from .io.restore import load_checkpoint
from .io.export import EngineLayout, export_adapters, export_weights
from .io.save import save_pretrained
from .io.sync import receive_weights, sync_weights
from .parallel.layers import LinearAllreduce, LinearLayer
from .planning.plan import Plan
from .parallel.replicas import check_replicas
from .planning.planner import build_plan
from .planning.policy import Origin
from .planning.sharding import Partition, Shard

__all__ = [
    "allreduce_gradients", "check_same_inputs", "clip_grad_norm_", "cp_group", "cp_rank", "cp_size",
    "data_parallel_sampler", "dp_cp_group", "dp_group", "dp_rank",
    "dp_mesh", "dp_size", "finish", "fully_shard", "tp_group", "tp_rank", "tp_size",
    "CheckpointError", "EngineLayout", "GatherReplacedLayerParams", "LinearAllreduce", "LinearLayer", "Origin", "Partition", "Plan",
    "Shard", "build_plan", "check_replicas", "consolidate", "explain", "export_adapters", "export_weights", "from_pretrained", "load_checkpoint", "receive_weights", "save_checkpoint",
    "save_pretrained", "sync_weights", "wrap",
]
__version__ = "0.1.0"
