"""Helpers the test modules share (a helper module, not a test module: test modules import it, never each other).

Tiny configs of every tested family (hidden <= 128, dropout off so runs are deterministic), the models and
batches built from them, and the per-rank parity run of a family.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import autotp
from autotp.testing import tiny_config
from autotp.testing import parity
from autotp.testing.varlen import varlen_reference

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
GPT = dict(n_embd=64, n_layer=2, n_head=8, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
           attn_pdrop=0.0)
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)

CONFIGS = {
    # the Llama family: separate q/k/v and gate/up projections
    "llama": lambda: tf.LlamaConfig(**COMMON),
    "mistral": lambda: tf.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: tf.Qwen2Config(**COMMON),  # q/k/v biases
    "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=16),  # per-head q_norm / k_norm
    "gemma": lambda: tf.GemmaConfig(**COMMON, head_dim=16),  # tied embeddings
    # fused projections, MQA/GQA, MoE, encoders
    "gpt2": lambda: tf.GPT2Config(**GPT),  # Conv1D, c_attn = [q | k | v]
    "gpt_neox": lambda: tf.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                         intermediate_size=96, vocab_size=256, max_position_embeddings=64,
                                         **NO_DROPOUT),
    "falcon": lambda: tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2,
                                      new_decoder_architecture=True, vocab_size=256, **NO_DROPOUT),
    "falcon_mqa": lambda: tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                          multi_query=True, vocab_size=256, **NO_DROPOUT),
    "bloom": lambda: tf.BloomConfig(hidden_size=64, n_layer=2, n_head=8, vocab_size=256, **NO_DROPOUT),
    "phi3": lambda: tf.Phi3Config(**COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                  pad_token_id=0),
    "opt": lambda: tf.OPTConfig(hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=8,
                                vocab_size=256, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0,
                                attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1),
    "gptj": lambda: tf.GPTJConfig(**GPT, rotary_dim=4),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(**GPT, multi_query=True),
    "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=64, mlp_only_layers=[0]),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, head_dim=16),
    "stablelm": lambda: tf.StableLmConfig(**COMMON, hidden_dropout=0.0, attention_dropout=0.0),
    "stablelm_qk_norm": lambda: tf.StableLmConfig(**COMMON, qk_layernorm=True, hidden_dropout=0.0,
                                                  attention_dropout=0.0),
    "starcoder2": lambda: tf.Starcoder2Config(**COMMON, residual_dropout=0.0, embedding_dropout=0.0,
                                              attention_dropout=0.0),
    "olmo2": lambda: tf.Olmo2Config(**COMMON),
    "roberta_causal": lambda: tf.RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                               intermediate_size=96, vocab_size=256, max_position_embeddings=64,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                               is_decoder=True),  # LM head whose bias is shared: stays replicated
    "llama4_text": lambda: tiny_config("llama4_text"),  # experts [gate | up] on dim 2, shared expert, L2 qk norm
    "bert": lambda: tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=96,
                                  vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0),
}
# Families no shipped policy covers: plans come from HF's base_model_tp_plan or structural detection.
DERIVED = {
    "olmo": lambda: tf.OlmoConfig(**COMMON),  # HF plan
    "cohere": lambda: tf.CohereConfig(**COMMON),  # HF plan
    "gpt_neo": lambda: tf.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=8, attention_types=[[["global", "local"], 1]],
                                       intermediate_size=96, vocab_size=256, max_position_embeddings=64,
                                       embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),  # detection
    "xglm": lambda: tf.XGLMConfig(d_model=64, num_layers=2, attention_heads=8, ffn_dim=96, vocab_size=256,
                                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, layerdrop=0.0),  # detection, nested blocks
}
CONFIGS.update(DERIVED)
LLAMA_FAMILY = ["gemma", "llama", "mistral", "qwen2", "qwen3"]
# Every other family a shipped policy covers: fused projections, MQA/GQA, MoE, encoders.
OTHER_POLICY_FAMILIES = [f for f in CONFIGS if f not in LLAMA_FAMILY and f not in DERIVED]


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised tiny model of `family`, the same on every rank for the same seed."""
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32)


def batch(vocab: int = 256, size: tuple[int, int] = (2, 16), seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, size, generator=generator)


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, **inputs) -> list[float]:
    """`steps` optimizer steps on one batch (forward with `inputs`, backward, step, zero_grad): the losses."""
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def labels_with_ignored(ids: torch.Tensor) -> torch.Tensor:
    """`ids` as labels with -100 over a prompt (row 0's first 5) and padding (row 1's last 3)."""
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt not to learn from
    labels[1, -3:] = -100  # padding
    return labels


def family_parity(rank: int, world: int, family: str, steps: int = 3, policy=None, config: dict | None = None) -> dict:
    """Runs on each rank: a tiny `family` model (its config edited by `config`), single process vs wrapped at
    tp=world; the `autotp.testing.compare_training` report."""
    return parity.compare_training(tiny_model(family, **(config or {})), batch(), world, steps, policy)


GPT2_DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def replicated_streams(rank: int, world: int, device: str = "cpu") -> list[bool]:
    """Runs on each rank: whether each block's output (the residual stream) is bit-identical on every TP rank, with
    GPT-2's dropout on `device` (tests/tp/test_dropout.py on CPU, tests/package/test_gpu.py on CUDA)."""
    torch.manual_seed(1000 + rank)  # ranks seeded differently on purpose: wrap must align the shared stream
    model = autotp.wrap(tiny_model("gpt2", **GPT2_DROPOUT).to(device), world)
    model.train()
    captured = []
    for block in model.transformer.h:  # each block's output is the residual stream: replicated
        block.register_forward_hook(lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    ids = batch().to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    same = []
    for tensor in captured:
        everyone = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(everyone, tensor.detach().contiguous())
        same.append(all(torch.equal(everyone[0], t) for t in everyone))
    return same


class SoftmaxMLP(nn.Module):
    """Same child names as a Llama MLP, but a softmax across the width: sharding the width would be wrong."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.softmax(self.gate_proj(x), dim=-1) * self.up_proj(x))


def trained_llama(tp: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny Llama wrapped at `tp` after one AdamW step, and its optimizer (state to save in a checkpoint)."""
    model = autotp.wrap(tiny_model("llama", seed=seed), tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


# --- resuming at another layout (tests/io/test_reshard_resume.py, tests/package/test_gpu.py) ---------------------------------

RESUME_BATCH = batch(vocab=250, size=(4, 16))  # the global batch: each DP replica takes its rows
RESUME_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"], lora_dropout=0.0, init_lora_weights=False)


def resume_model(kind: str, seed: int, device: str = "cpu") -> nn.Module:
    """Llama with 2 KV heads (replicated at tp=4) and a vocabulary of 250 (uneven over 4); Gemma (tied embeddings,
    same sizes); a Qwen3-MoE whose expert width (40) splits into 10 rows at tp=4; LoRA adapters on that Llama; GPT-2
    and Phi-3, whose fused projections (c_attn [q | k | v], qkv_proj, gate_up_proj) hold several runs per rank."""
    if kind in ("gpt2", "phi3"):
        return tiny_model(kind, seed=seed, vocab_size=250).to(device)
    if kind == "qwen3_moe":
        config = tiny_config("qwen3_moe")
        config.moe_intermediate_size, config.vocab_size = 40, 250
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model = tiny_model("gemma" if kind == "gemma" else "llama", seed=seed, num_key_value_heads=2, vocab_size=250)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**RESUME_LORA))
    return model.to(device)


def resume_training(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def resume_steps(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 count: int) -> list[float]:
    """`count` steps on this replica's rows of the global batch; the global batch's loss (mean over replicas)."""
    wrapped = any(hasattr(m, "autotp_state") for m in model.modules())
    dp, replica = (autotp.dp_size(model), autotp.dp_rank(model)) if wrapped else (1, 0)
    rows = RESUME_BATCH.shape[0] // dp
    device = next(model.parameters()).device
    ids = RESUME_BATCH[replica * rows:(replica + 1) * rows].to(device)
    losses = []
    for _ in range(count):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if wrapped:
            autotp.allreduce_gradients(model)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total, group=autotp.dp_group(model))
        losses.append(total.item() / dp)
    return losses


def resume_layout(kind: str, tp: int, fsdp: bool, seed: int, device: str = "cpu") -> tuple:
    """The model wrapped at `tp` (LoRA: the model PEFT holds, as the README shows), under FSDP if asked, its AdamW
    and scheduler."""
    model = resume_model(kind, seed, device)
    if kind == "lora":
        autotp.wrap(model.base_model.model, tp)
    else:
        model = autotp.wrap(model, tp)
    if fsdp:
        model = autotp.fully_shard(model)
    return (model, *resume_training(model))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    group = autotp.tp_group(model) if dist.is_initialized() else None
    return {n: parity.full_tensor(p, p, group).detach().cpu().clone() for n, p in model.named_parameters()}


def first_half(rank: int, world: int, kind: str, tp: int, fsdp: bool, path: str, device: str = "cpu") -> list[float]:
    """Runs on each rank: 3 steps at `tp` x `world // tp`, then `save_checkpoint`."""
    model, optimizer, scheduler = resume_layout(kind, tp, fsdp, seed=0, device=device)
    losses = resume_steps(model, optimizer, scheduler, 3)
    autotp.save_checkpoint(path, model, optimizer, scheduler, step=3, samples=3 * RESUME_BATCH.shape[0])
    return losses


def second_half(rank: int, world: int, kind: str, tp: int, fsdp: bool, path: str, device: str = "cpu") -> dict:
    """Runs on each rank (or in one process without torch.distributed, `tp=0`): load, then 3 more steps."""
    torch.manual_seed(999)  # whatever: the checkpoint's state must win
    if tp:
        model, optimizer, scheduler = resume_layout(kind, tp, fsdp, seed=7, device=device)  # other weights
    else:
        model = resume_model(kind, seed=7, device=device)
        optimizer, scheduler = resume_training(model)
    state = autotp.load_checkpoint(path, model, optimizer, scheduler)
    return {"state": state, "losses": resume_steps(model, optimizer, scheduler, 3), "params": full_params(model)}


def straight_run(kind: str, device: str = "cpu") -> dict:
    """The reference: 6 steps in one process, built as a user would (the same seed and calls)."""
    model = resume_model(kind, seed=0, device=device)
    return {"losses": resume_steps(model, *resume_training(model), 6), "params": full_params(model)}


def check_resume(report: dict, expected: dict, label: str) -> None:
    """fp32: only the order of sums differs, so the parity tolerances hold (loss 1e-5, parameters 3e-5)."""
    assert report["state"] == {"step": 3, "samples": 12}, (label, report["state"])
    worst_loss = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"][3:]))
    assert worst_loss <= parity.LOSS_ATOL, (label, report["losses"], expected["losses"][3:])
    worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
    assert worst[0] <= parity.PARAM_ATOL, (label, worst)


# --- context parallelism (tests/cp/test_context_parallel.py, benchmarks/long_context.py) ---

CP_FAMILIES = {"llama": dict(num_key_value_heads=2), "qwen3": {}, "mixtral": {},  # llama: 2 KV heads
               "llama_mqa": dict(num_key_value_heads=1),  # one KV head: replicated on both TP ranks at tp=2
               "qwen3_uneven": dict(num_attention_heads=6, num_key_value_heads=2),  # tp=4: heads 2/2/1/1
               "mixtral_aux": dict(output_router_logits=True, router_aux_loss_coef=0.5)}  # the load-balancing loss


def cp_inputs(mode: str, rows: int = 2, seq: int = 16) -> tuple[dict, dict]:
    """(inputs of the CP model, inputs of the one-process reference) for one batch.

    - "plain": causal, every token a target;
    - "packed": documents packed as TRL packs them (position_ids restarting at each); the reference runs with
      use_cache=False and no attention mask, so transformers detects the packing;
    - "padding": right padding on row 1 and left padding on row 0 (attention_mask 0, labels -100), at a length
      that is not a multiple of 2 cp (autotp pads it).
    """
    ids = batch(size=(rows, seq))
    labels = ids.clone()
    if mode == "plain":
        return {"input_ids": ids, "labels": labels}, {"input_ids": ids, "labels": labels}
    if mode == "packed":
        lengths = [[5, 7, seq - 12], [9, seq - 9]]
        positions = torch.stack([torch.cat([torch.arange(n) for n in lengths[r % 2]]) for r in range(rows)])
        inputs = {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}
        return inputs, dict(inputs)
    ids, labels = ids[:, :seq - 2], labels[:, :seq - 2]
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[0, :2] = 0
    labels[mask == 0] = -100
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return inputs, dict(inputs)


def cp_models(family: str, attn: str = "sdpa") -> tuple[nn.Module, nn.Module]:
    """(one process's tiny `family` model, a copy of it to wrap under CP), as a user builds them from one seed. With
    `attn="varlen_reference"` the copy runs the flash branch, through a reference function with flash's signature,
    against one process's sdpa."""
    import copy

    reference = tiny_model(family.split("_")[0], **CP_FAMILIES.get(family, {}))
    reference.set_attn_implementation("sdpa" if attn == "varlen_reference" else attn)
    model = copy.deepcopy(reference)
    if attn == "varlen_reference":
        tf.AttentionInterface.register(attn, varlen_reference)
        model.set_attn_implementation(attn)
    return reference, model


def cp_parity(rank: int, world: int, family: str, tp: int, cp: int, mode: str = "plain", fsdp: bool = False,
              attn: str = "sdpa", checkpointing: bool = False, sequence_parallel: bool = False, steps: int = 3) -> dict:
    """Runs on each rank: a tiny `family` model in one process against a copy wrapped at tp x cp (x dp, under
    `autotp.fully_shard` if asked), `steps` AdamW steps on one global batch (DP replica d its rows d::dp). Returns
    the worst loss difference, gradient error (step 0) and parameter difference, as `autotp.testing.parity`."""
    reference, model = cp_models(family, attn)
    model = autotp.wrap(model, tp, cp_size=cp, sequence_parallel=sequence_parallel)
    if checkpointing:  # transformers' activation checkpointing of each decoder layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp:
        model = autotp.fully_shard(model)
    dp, replica = autotp.dp_size(model), autotp.dp_rank(model)
    inputs, ref_inputs = cp_inputs(mode, rows=2 * dp)
    mine = {k: v[replica::dp] if torch.is_tensor(v) else v for k, v in inputs.items()}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (reference, model)]
    ref_params = dict(reference.named_parameters())
    group = autotp.tp_group(model)
    report = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        ref_loss = reference(**ref_inputs).loss
        ref_loss.backward()
        loss = model(**mine).loss
        loss.backward()
        autotp.allreduce_gradients(model)
        total = loss.detach().clone()
        dist.all_reduce(total, group=autotp.dp_group(model))
        report["loss"] = max(report["loss"], abs(total.item() / dp - ref_loss.item()))
        if step == 0:
            for name, p in model.named_parameters():
                got = parity.full_tensor(p.grad, p, group)
                report["grad"] = max(report["grad"], parity.grad_error(got, ref_params[name].grad))
            norm = autotp.clip_grad_norm_(model, 1e9)  # the whole model's, as one process's (nothing clipped)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
            report["grad"] = max(report["grad"], abs(norm.item() / expected.item() - 1))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, p in model.named_parameters():
        diff = (parity.full_tensor(p, p, group) - ref_params[name].detach()).abs().max().item()
        report["param"] = max(report["param"], diff)
    return report


def cp_parity_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """`cp_parity` for each (family, tp, cp, mode, fsdp, attn[, checkpointing]) in one set of ranks (one start-up for
    several)."""
    return [cp_parity(rank, world, *case) for case in cases]


def assert_cp_parity(reports: list[dict], label: str) -> None:
    for report in reports:
        assert report["loss"] <= parity.LOSS_ATOL, (label, report)
        assert report["grad"] <= parity.GRAD_RTOL, (label, report)
        assert report["param"] <= parity.PARAM_ATOL, (label, report)


def cp_ddp(rank: int, world: int, group: str) -> float:
    """Runs on each rank: DDP over `dp_cp_group` (or `dp_group`, refused) on a model at cp=2; the embedding's
    gradient error against one process."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    reference = tiny_model("llama", **CP_FAMILIES["llama"])
    model = autotp.wrap(copy.deepcopy(reference), 1, cp_size=2)
    ddp = DistributedDataParallel(model, process_group=getattr(autotp, group)(model))
    ids = batch()
    reference(input_ids=ids, labels=ids).loss.backward()
    ddp(input_ids=ids, labels=ids).loss.backward()
    return parity.grad_error(model.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad)


def cp_held_bytes(rank: int, world: int, seq: int) -> int:
    """Runs on each rank: the activation bytes autograd holds after one forward of a tiny Llama over one sequence of
    `seq` tokens at cp=world (`autotp.testing.memory`)."""
    from autotp.testing.memory import KeptForBackward

    model = autotp.wrap(tiny_model("llama", **CP_FAMILIES["llama"], max_position_embeddings=seq), 1, cp_size=world)
    ids = batch(size=(1, seq))
    kept = KeptForBackward(model)
    with kept.hooks:
        loss = model(input_ids=ids, labels=ids).loss
    held = kept.bytes()
    loss.backward()
    return held


def cp_lora_parity(rank: int, world: int, tp: int) -> dict:
    """Runs on each rank: PEFT's LoRA on a tiny Llama (get_peft_model, then `wrap` of the model it holds, as the
    README shows), one process against tp x cp=world/tp, 3 AdamW steps on packed documents; the worst loss, gradient
    and parameter differences."""
    import copy

    from peft import LoraConfig, get_peft_model

    reference = get_peft_model(tiny_model("llama", **CP_FAMILIES["llama"]), LoraConfig(**RESUME_LORA))
    model = copy.deepcopy(reference)
    autotp.wrap(model.base_model.model, tp, cp_size=world // tp)
    inputs, ref_inputs = cp_inputs("packed")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_params = dict(reference.named_parameters())
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
                  for m in (reference, model)]
    group = autotp.tp_group(model)
    report = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(3):
        ref_loss = reference(**ref_inputs).loss
        ref_loss.backward()
        loss = model(**inputs).loss
        loss.backward()
        autotp.allreduce_gradients(model)
        report["loss"] = max(report["loss"], abs(loss.item() - ref_loss.item()))
        if step == 0:
            for name, p in trainable:
                got = parity.full_tensor(p.grad, p, group)
                report["grad"] = max(report["grad"], parity.grad_error(got, ref_params[name].grad))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, p in trainable:
        diff = (parity.full_tensor(p, p, group) - ref_params[name].detach()).abs().max().item()
        report["param"] = max(report["param"], diff)
    return report


def cp_dropout_parity(rank: int, world: int, tp: int) -> dict:
    """Runs on each rank: Phi-3 with hidden-state and embedding dropout 0.1, one process against tp x cp=world/tp,
    each forward from the same seed (ranks seeded apart first: wrap aligns the CP ranks' streams); 2 AdamW steps."""
    import copy

    torch.manual_seed(0)
    reference = tiny_model("phi3", resid_pdrop=0.1, embd_pdrop=0.1)
    torch.manual_seed(100 + rank)
    model = autotp.wrap(copy.deepcopy(reference), tp, cp_size=world // tp)
    reference.train()
    model.train()
    inputs, ref_inputs = cp_inputs("packed")
    ref_params = dict(reference.named_parameters())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (reference, model)]
    report = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(2):
        seed = torch.randint(0, 1 << 30, ()).item()  # the same on every rank: the streams are aligned
        torch.manual_seed(seed)
        ref_loss = reference(**ref_inputs).loss
        ref_loss.backward()
        torch.manual_seed(seed)
        loss = model(**inputs).loss
        loss.backward()
        autotp.allreduce_gradients(model)
        report["loss"] = max(report["loss"], abs(loss.item() - ref_loss.item()))
        if step == 0:
            with torch.no_grad():  # the masks are on: the loss differs from evaluation's
                report["dropped"] = abs(reference.eval()(**ref_inputs).loss.item() - ref_loss.item())
                reference.train()
            for name, p in model.named_parameters():
                got = parity.full_tensor(p.grad, p, autotp.tp_group(model))
                report["grad"] = max(report["grad"], parity.grad_error(got, ref_params[name].grad))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, p in model.named_parameters():
        diff = (parity.full_tensor(p, p, autotp.tp_group(model)) - ref_params[name].detach()).abs().max().item()
        report["param"] = max(report["param"], diff)
    return report


def cp_compiled(rank: int, world: int) -> dict:
    """Runs on each rank: a tiny Llama at cp=world compiled (aot_eager) against one process; the loss and gradient
    differences and torch._dynamo.explain's graph-break count."""
    import copy

    reference = tiny_model("llama", **CP_FAMILIES["llama"])
    model = autotp.wrap(copy.deepcopy(reference), 1, cp_size=world)
    inputs, ref_inputs = cp_inputs("packed")
    breaks = torch._dynamo.explain(model)(**inputs).graph_break_count
    torch._dynamo.reset()
    loss = torch.compile(model, backend="aot_eager")(**inputs).loss
    loss.backward()
    autotp.allreduce_gradients(model)
    ref_loss = reference(**ref_inputs).loss
    ref_loss.backward()
    grad = max(parity.grad_error(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": grad, "param": 0.0, "breaks": breaks}


def cp_weights_aligned(rank: int, world: int) -> float:
    """Runs on each rank: a model built with a seed of its own, wrapped at cp=world; the largest difference of its
    weights from CP rank 0's after `wrap` (which broadcasts them)."""
    model = autotp.wrap(tiny_model("llama", seed=rank, **CP_FAMILIES["llama"]), 1, cp_size=world)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, 0)
    return (flat - first).abs().max().item()


def cp_deepcopy(rank: int, world: int) -> tuple[float, float, bool]:
    """Runs on each rank: `copy.deepcopy` of a model at cp=world (an EMA or reference model); both losses, and whether
    the copy has a CP object of its own, bound to itself."""
    import copy

    model = autotp.wrap(tiny_model("llama", **CP_FAMILIES["llama"]), 1, cp_size=world)
    twin = copy.deepcopy(model)
    ids = batch()
    own = twin.autotp_state.context is not model.autotp_state.context and twin.loss_function.context.model is twin
    return model(input_ids=ids, labels=ids).loss.item(), twin(input_ids=ids, labels=ids).loss.item(), own


def cp_unsynced_step(rank: int, world: int) -> str:
    """Runs on each rank: a step at cp=world without summing the gradients over CP (refused), then with it."""
    model = autotp.wrap(tiny_model("llama", **CP_FAMILIES["llama"]), 1, cp_size=world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        optimizer.step()
    except RuntimeError as err:
        refused = str(err)
    else:
        refused = ""
    autotp.allreduce_gradients(model)
    optimizer.step()  # summed: allowed
    return refused


def cp_aux_with_padding(rank: int, world: int) -> str:
    """Runs on each rank: Mixtral's load-balancing loss with a padding mask at cp=world (refused)."""
    model = autotp.wrap(tiny_model("mixtral", **CP_FAMILIES["mixtral_aux"]), 1, cp_size=world)
    inputs, _ = cp_inputs("padding")
    try:
        model(**inputs)
    except NotImplementedError as err:
        return str(err)
    return ""


def cp_per_token_input(rank: int, world: int) -> str:
    """Runs on each rank: a forward at cp=world given a per-token input CP does not split (refused)."""
    model = autotp.wrap(tiny_model("llama", **CP_FAMILIES["llama"]), 1, cp_size=world)
    ids = batch()
    try:
        model(input_ids=ids, labels=ids, token_type_ids=torch.zeros_like(ids))
    except NotImplementedError as err:
        return str(err)
    return ""


def cp_parity_in_blocks(rank: int, world: int, mode: str) -> dict:
    """`cp_parity` with sdpa's query blocks cut to 3 rows (`context_kernels.MASK_ELEMENTS`), as at long sequences."""
    from autotp.cp import attention as context_kernels

    context_kernels.MASK_ELEMENTS = 3 * 16 * 2  # rows x padded length x batch
    return cp_parity(rank, world, "llama", 1, world, mode)


class Sequences(Dataset):
    """`size` random token sequences labelled with themselves (a Trainer dataset); `index_of` tells which sample each
    row of a batch is, so a test can say which samples a step read."""

    def __init__(self, size: int, seq: int = 16, vocab: int = 256):
        self.ids = torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}

    def index_of(self, rows: torch.Tensor) -> list[int]:
        return [int((self.ids == row).all(1).nonzero()[0]) for row in rows.cpu()]
