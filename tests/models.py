"""Helpers the test modules of several packages share (a helper module, not a test module: test modules import it,
never each other).

Tiny configs of every tested family (hidden <= 128, dropout off so runs are deterministic), the models and
batches built from them, and the per-rank parity run of a family. Workers of one package live beside its tests
(tests/io/resume_workers.py, tests/cp/cp_workers.py); pyproject.toml's pytest `pythonpath` puts those folders on
sys.path, so a test in another package imports them too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf
from safetensors import safe_open
from torch import nn
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import autotp
from autotp.planning.report import summary
from autotp.testing import parity, tiny_config

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=64,
)
GPT = dict(
    n_embd=64, n_layer=2, n_head=8, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)
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
    "gpt_neox": lambda: tf.GPTNeoXConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        intermediate_size=96,
        vocab_size=256,
        max_position_embeddings=64,
        **NO_DROPOUT,
    ),
    "falcon": lambda: tf.FalconConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_kv_heads=2,
        new_decoder_architecture=True,
        vocab_size=256,
        **NO_DROPOUT,
    ),
    "falcon_mqa": lambda: tf.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=8, multi_query=True, vocab_size=256, **NO_DROPOUT
    ),
    "bloom": lambda: tf.BloomConfig(hidden_size=64, n_layer=2, n_head=8, vocab_size=256, **NO_DROPOUT),
    "phi3": lambda: tf.Phi3Config(**COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0),
    "opt": lambda: tf.OPTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=96,
        num_attention_heads=8,
        vocab_size=256,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
    ),
    "gptj": lambda: tf.GPTJConfig(**GPT, rotary_dim=4),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(**GPT, multi_query=True),
    "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(
        **COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[0],
    ),
    "gemma2": lambda: tf.Gemma2Config(**COMMON, head_dim=16),
    "stablelm": lambda: tf.StableLmConfig(**COMMON, hidden_dropout=0.0, attention_dropout=0.0),
    "stablelm_qk_norm": lambda: tf.StableLmConfig(
        **COMMON, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0
    ),
    "starcoder2": lambda: tf.Starcoder2Config(
        **COMMON, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0
    ),
    "olmo2": lambda: tf.Olmo2Config(**COMMON),
    "roberta_causal": lambda: tf.RobertaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        intermediate_size=96,
        vocab_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,
    ),  # LM head whose bias is shared: stays replicated
    "llama4_text": lambda: tiny_config("llama4_text"),  # experts [gate | up] on dim 2, shared expert, L2 qk norm
    "bert": lambda: tf.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        intermediate_size=96,
        vocab_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
}
# Families no shipped policy covers: plans come from HF's base_model_tp_plan or structural detection.
DERIVED = {
    "olmo": lambda: tf.OlmoConfig(**COMMON),  # HF plan
    "cohere": lambda: tf.CohereConfig(**COMMON),  # HF plan
    "gpt_neo": lambda: tf.GPTNeoConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        attention_types=[[["global", "local"], 1]],
        intermediate_size=96,
        vocab_size=256,
        max_position_embeddings=64,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
    ),  # detection
    "xglm": lambda: tf.XGLMConfig(
        d_model=64,
        num_layers=2,
        attention_heads=8,
        ffn_dim=96,
        vocab_size=256,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    ),  # detection, nested blocks
}
CONFIGS.update(DERIVED)
# Token mixers sharded by heads or channels (tests/tp/test_mixers.py); not in CONFIGS, whose sweeps they would lengthen
MIXERS = {
    # a short convolution (layer 0) and attention with per-head norms (layer 1)
    "lfm2": lambda: tf.Lfm2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
        layer_types=["conv", "full_attention"],
        conv_bias=True,
        block_auto_adjust_ff_dim=False,
    ),
    # an RG-LRU recurrent block (layer 0) and local attention (layer 1)
    "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        block_types=["recurrent", "attention"],
        attention_window_size=16,
    ),
    # time mixing (per-channel recurrence, its state in the model's list) and channel mixing
    "rwkv": lambda: tf.RwkvConfig(
        hidden_size=64,
        attention_hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=256,
        context_length=64,
    ),
    # a gated delta-net (layer 0: 4 key heads, 2 value heads each; planned from transformers' plan and
    # policies/mixers.toml, verified by emulation) and gated attention (layer 1), each with MoE experts
    "qwen3_next": lambda: tf.Qwen3NextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        vocab_size=256,
        max_position_embeddings=64,
    ),
    # delta attention (layer 0: per-channel decay, low-rank gates kept whole; from policies/mixers.toml, verified
    # by emulation) and MLA attention (layer 1)
    "kimi_linear": lambda: tf.KimiLinearConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        linear_num_heads=4,
        linear_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=256,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Bailing-hybrid's delta attention (layer 0: full-rank forget and output gates; from policies/mixers.toml,
    # verified by emulation), then MLA attention with MoE experts (layer 1)
    "bailing_hybrid": lambda: tf.BailingHybridConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        num_attention_heads=4,  # the delta attention's heads too (linear_num_heads)
        num_key_value_heads=4,
        head_dim=16,  # the delta attention's head dim (linear_head_dim)
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        vocab_size=256,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Qwen3.5's gated delta-net (q | k | v in one projection of unequal parts), then gated attention
    "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=64,
    ),
}
# Families the causal sweep once left whole, at the sweep's tiny config: TrOCR's decoder-layer MLP and Moshi's wrapped
# attention and packed MLP (shipped policies), Beam's gated attention with a per-head gate bias (transformers' plan).
# One spawn runs them all (tests/families/test_families.py), so they stay out of the per-family sweeps.
MORE_FAMILIES = {family: (lambda family=family: tiny_config(family)) for family in ("trocr", "moshi", "beam")}
LLAMA_FAMILY = ["gemma", "llama", "mistral", "qwen2", "qwen3"]
# Every other family a shipped policy covers: fused projections, MQA/GQA, MoE, encoders.
OTHER_POLICY_FAMILIES = [f for f in CONFIGS if f not in LLAMA_FAMILY and f not in DERIVED]
CONFIGS.update(MORE_FAMILIES)


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised tiny model of `family`, the same on every rank for the same seed."""
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM
    if getattr(config, "vision_config", None) is not None:  # a VLM (tests/pp): its image-text-to-text class
        auto = tf.AutoModelForImageTextToText
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


# PEFT's LoRA on every Llama projection (tests/io/resume_workers.py, tests/cp/cp_workers.py)
RESUME_LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_dropout=0.0,
    init_lora_weights=False,
)


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


def tensors(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """file name -> {tensor name: tensor} of every safetensors file in `directory`."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out[file.name] = {name: f.get_tensor(name) for name in f.keys()}
    return out


def assert_same_checkpoint(ours: Path, theirs: Path, config: bool = True) -> None:
    """The same files, each with the same tensors in the same order (names, shapes, dtypes, values), the same index
    and (unless `config=False`) the same config."""
    mine, expected = tensors(ours), tensors(theirs)
    assert list(mine) == list(expected)
    for file, named in expected.items():
        assert list(mine[file]) == list(named), file
        for name, tensor in named.items():
            got = mine[file][name]
            assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
            assert torch.equal(got, tensor), name
    index = "model.safetensors.index.json"
    assert (ours / index).exists() == (theirs / index).exists()
    if (theirs / index).exists():
        assert json.loads((ours / index).read_text()) == json.loads((theirs / index).read_text())
    if config:
        assert json.loads((ours / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())


# A forward that raises (tests/tp/test_raised_forward.py, tests/ep/test_ep_modality.py)
OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)"  # what accelerate retries on


class FailOnce:
    """A forward hook that raises an out-of-memory error the first time its module runs."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError(OUT_OF_MEMORY)


def held_by_autotp(model: nn.Module) -> dict[int, str]:
    """The tensors (not parameters or buffers) held by the objects autotp keeps on the model's modules, id -> a path
    to it: the modules' hooks and public attributes, walked through containers, bound methods and autotp's objects."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    found: dict[int, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, object]] = []
    for name, module in model.named_modules():
        hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
        stack += [(f"{name} hook {i}", hook) for i, hook in enumerate(hooks)]
        stack += [(f"{name}.{key}", value) for key, value in vars(module).items() if not key.startswith("_")]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, str, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            if id(obj) not in own:
                found[id(obj)] = f"{path} {list(obj.shape)}"
        elif isinstance(obj, dict):
            stack += [(f"{path}[{key!r}]", value) for key, value in obj.items()]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):  # a bound method
            stack.append((path, obj.__self__))
        elif type(obj).__module__.startswith("autotp") and hasattr(obj, "__dict__"):
            stack += [(f"{path}.{key}", value) for key, value in vars(obj).items()]
    return found


def focal_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """A user's causal-LM loss, as transformers calls a model's `loss_function`: the mean focal loss (gamma 2) of the
    next tokens, which is not cross-entropy and ignores `num_items_in_batch`."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logp = F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
    target = shift_labels.reshape(-1).to(logp.device)
    kept = target != ignore_index
    picked = logp[kept].gather(-1, target[kept, None]).squeeze(-1)
    return (-((1 - picked.exp()) ** 2) * picked).mean()


def step_bytes(model: nn.Module) -> tuple[int, int]:
    """The all-reduce bytes `autotp plan` predicts for a training step, and those a step moves (after a first one:
    it checks the random streams once)."""
    ids = batch(512, (1, 8))
    predicted = summary(model, model.autotp_state.plan, *ids.shape)["collective_bytes_per_step"]
    model(ids, labels=ids).loss.backward()
    moved, original = [0], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        moved[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        dist.all_reduce = original
    return predicted, moved[0]


def edited_model(family: str, edits: dict) -> torch.nn.Module:
    """`family`'s tiny config with `edits`, built in fp32 from seed 0."""
    tiny = tiny_config(family)
    config = type(tiny)(**{**tiny.to_dict(), **edits})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def cached_generation(reference: torch.nn.Module, model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """Greedy generation with the cache, both models: whether the tokens are equal, and the last cached step's
    logits' largest difference over their scale."""
    out = {}
    for name, m in (("reference", reference), ("wrapped", model)):
        m.eval()
        with torch.no_grad():
            tokens = m.generate(ids[:, :6], max_new_tokens=4, do_sample=False, use_cache=True)
            out[name] = (tokens, m(tokens).logits[:, -1])
    (tokens, logits), (got, got_logits) = out["reference"], out["wrapped"]
    scale = logits.abs().max().item() or 1.0
    return {"tokens": torch.equal(tokens, got), "logits": (logits - got_logits).abs().max().item() / scale}
