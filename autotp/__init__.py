"""autotp: one-call tensor parallelism for Hugging Face models, for training.

    model = autotp.wrap(model, tp_size=4)       # under torchrun / accelerate launch
    autotp.save_pretrained(model, "out/")       # full HF checkpoint

Layers, bottom to top; a module imports only from its own layer or the layers below it
(tests/package/test_layering.py parses every import, those inside functions included, and fails on an
upward import or a cycle). Each folder is one concern; its `__init__` says what it is for and what it may import.

1. dependency boundaries: `compat`, `compat.versions`, `compat.peft`, `compat.torch`, `compat.trainer`,
   `compat.hf`, `compat.hf_conversion`, `compat.torchao`
2. plan data, no torch.distributed: `planning`, `options`, `planning.sharding`, `planning.placement`, `planning.policy`,
   `planning.linears`, `planning.plan`, `planning.components`
3. building a plan: `planning.derive`, `planning.twin`, `planning.probe`, `planning.verify`, `planning.logits_path`,
   `planning.head_params`, `planning.expert_linears`, `planning.adapters`, `planning.policy_plan`, `planning.ties`, `planning.mixers`, `planning.planner`, `planning.report`
4. the mesh, the state and the shared runtime: `mesh`, `state`, `accessors`, `runtime`, `runtime.rows`, `runtime.collectives`,
   `runtime.seq_collectives`, `runtime.grad_hooks`, `runtime.replicas`, `runtime.agreement`, `runtime.rollback`,
   `runtime.process_hooks`, `runtime.replaced`, `runtime.slot_guard`, `runtime.input_agreement`, `runtime.rng`,
   `runtime.shards`, `runtime.lazy_logits`, `runtime.param_steps`, `runtime.second_order`, `runtime.dimension`,
   `runtime.forward_end`
5. the dimensions, one package each (tp is the base the others extend; no other pair imports each other):
   `tp`, `tp.overlap`, `tp.glu`, `tp.float8`, `tp.block_entry`, `tp.params`, `tp.layers`, `tp.mixer`, `tp.heads`, `tp.inplace`, `tp.mixer_state`, `tp.streams`, `tp.state_dict`, `tp.apply`,
   `tp.hooked`, `tp.lora`, `tp.lora_lift`, `tp.dimension`, `vocab`, `vocab.layers`, `vocab.chunked`, `vocab.logprobs`, `vocab.tokens`, `vocab.apply`,
   `vocab.dimension`, `sp`, `sp.sequence`, `sp.dimension`, `cp`, `cp.layout`, `cp.dropout`, `cp.attention`, `cp.loss`,
   `cp.support`, `cp.apply`, `cp.dimension`, `dp`, `dp.ddp`, `dp.fsdp`, `ep`, `ep.collectives`,
   `ep.grads`, `ep.fsdp`, `ep.groups`, `ep.dispatch`, `ep.regions`, `ep.guard`, `ep.gathered`, `ep.modality`,
   `ep.apply`, `ep.dimension`, `pp`, `pp.cut`, `pp.release`, `pp.router`, `pp.sharded`, `pp.draws`, `pp.zero_bubble`, `pp.schedule`, `pp.shared`, `pp.chain`, `pp.stage_names`, `pp.stage_tensors`, `pp.dimension`, `pp.generate`, `pp.own_loss`, `pp.report`
6. files: `io`, `io.errors`, `io.streaming`, `io.staging`, `io.hf`, `io.hf.safetensors`, `io.hf.parts`,
   `io.hf.save`, `io.hf.load`, `io.checkpoint`, `io.checkpoint.rng_state`, `io.checkpoint.chunks`,
   `io.checkpoint.save`, `io.checkpoint.legacy`, `io.checkpoint.legacy_optimizer`, `io.checkpoint.restore`,
   `io.checkpoint.latest`, `io.checkpoint.consolidate`, `io.rollout`, `io.rollout.adapters`, `io.rollout.vllm_layout`, `io.rollout.row_gather`, `io.rollout.gathers`, `io.rollout.export`, `io.rollout.sync`,
   `io.rollout.vllm_source`, `io.rollout.vllm_channel`, `io.rollout.vllm_reload`, `io.rollout.vllm_gloo`, `io.rollout.vllm_gloo_worker`, `io.rollout.vllm_connect`, `io.rollout.vllm_check`,
   `io.rollout.vllm_client`
7. the integrations and the entry points: `integrations`, `integrations.guards`, `integrations.gather`,
   `integrations.hf_methods`, `parallelize`, `api`
8. the parity harness: `testing`, `testing.spawn`, `testing.tiny`, `testing.parity`, `testing.memory`,
   `testing.varlen`
9. tools: `cli`, `integrations.fused_head`, `integrations.trl`, `integrations.batch_rows`, `integrations.trl_pipeline`,
   `integrations.replica_metrics`, `integrations.trainer`, `integrations.trainer_checkpoints`, `hf_trainer`, `rollout`,
   `__main__`, `__init__` (this package)
"""

from . import rollout as rollout  # vLLM-free: autotp.rollout.vllm_sync imports vLLM when called
from .accessors import (
    cp_group,
    cp_rank,
    cp_size,
    dp_cp_group,
    dp_group,
    dp_rank,
    dp_size,
    ep_group,
    ep_rank,
    ep_size,
    group,
    pp_group,
    pp_rank,
    pp_size,
    rank,
    size,
    tp_group,
    tp_rank,
    tp_size,
)
from .api import explain, from_pretrained, wrap
from .dp.ddp import allreduce_gradients, clip_grad_norm_, data_parallel_sampler
from .dp.fsdp import dp_cp_mesh, dp_mesh, fully_shard
from .integrations.gather import GatherReplacedLayerParams
from .integrations.guards import check_same_inputs
from .io.checkpoint.consolidate import consolidate
from .io.checkpoint.latest import latest_checkpoint
from .io.checkpoint.restore import load_checkpoint
from .io.checkpoint.save import save_checkpoint
from .io.errors import CheckpointError
from .io.hf.save import save_pretrained
from .io.rollout.export import EngineLayout, export_adapters, export_weights
from .io.rollout.sync import receive_weights, sync_weights
from .mesh import finish
from .planning.plan import Plan
from .planning.planner import build_plan
from .planning.policy import Origin
from .planning.sharding import Partition, Shard
from .runtime.dimension import forward_backward
from .runtime.replicas import check_replicas
from .tp.layers import LinearAllreduce, LinearLayer

__all__ = [
    "allreduce_gradients",
    "check_same_inputs",
    "clip_grad_norm_",
    "cp_group",
    "cp_rank",
    "cp_size",
    "data_parallel_sampler",
    "dp_cp_group",
    "dp_group",
    "dp_rank",
    "ep_group",
    "ep_rank",
    "ep_size",
    "dp_cp_mesh",
    "dp_mesh",
    "dp_size",
    "finish",
    "forward_backward",
    "fully_shard",
    "pp_group",
    "pp_rank",
    "pp_size",
    "group",
    "rank",
    "size",
    "tp_group",
    "tp_rank",
    "tp_size",
    "CheckpointError",
    "EngineLayout",
    "GatherReplacedLayerParams",
    "LinearAllreduce",
    "LinearLayer",
    "Origin",
    "Partition",
    "Plan",
    "Shard",
    "build_plan",
    "check_replicas",
    "consolidate",
    "explain",
    "export_adapters",
    "export_weights",
    "from_pretrained",
    "latest_checkpoint",
    "load_checkpoint",
    "receive_weights",
    "save_checkpoint",
    "save_pretrained",
    "sync_weights",
    "wrap",
]
__version__ = "0.1.0"
