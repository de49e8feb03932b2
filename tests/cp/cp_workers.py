"""Context parallelism: the rank workers, inputs and model pairs of tests/cp/ (a helper module beside the CP tests;
pytest's `pythonpath` puts this folder on sys.path, for tests/parallelize/ which uses `CP_FAMILIES`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn

import autotp
from autotp.testing import parity
from autotp.testing.varlen import varlen_reference
from models import RESUME_LORA, batch, tiny_model

CP_FAMILIES = {
    "llama": dict(num_key_value_heads=2),
    "qwen3": {},
    "mixtral": {},  # llama: 2 KV heads
    "llama_mqa": dict(num_key_value_heads=1),  # one KV head: replicated on both TP ranks at tp=2
    "qwen3_uneven": dict(num_attention_heads=6, num_key_value_heads=2),  # tp=4: heads 2/2/1/1
    "mixtral_aux": dict(output_router_logits=True, router_aux_loss_coef=0.5),
}  # the load-balancing loss


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
    ids, labels = ids[:, : seq - 2], labels[:, : seq - 2]
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


def cp_parity(
    rank: int,
    world: int,
    family: str,
    tp: int,
    cp: int,
    mode: str = "plain",
    fsdp: bool = False,
    attn: str = "sdpa",
    checkpointing: bool = False,
    sequence_parallel: bool = False,
    steps: int = 3,
) -> dict:
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
    optimizers = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, eps=1e-6) for m in (reference, model)
    ]
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
    from autotp.cp.dimension import ContextParallelism

    mine, theirs = (m.autotp_state.dim(ContextParallelism).context for m in (model, twin))
    own = theirs is not mine and twin.loss_function.context.model is twin
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
