"""`autotp.export_weights` yields what transformers' `save_pretrained` of the same one-process model writes (names,
shapes, values), LoRA merged on the fly, cut to an engine's TP rows with `target=`, and broadcast to stand-in engine
processes by `sync_weights`; a rank that stops early makes the others raise; memory stays within a bucket + a tensor.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import tiny_config
from autotp.testing.parity import PARAM_ATOL
from autotp.testing.spawn import free_port, run_ranks
from models import batch, tiny_model, train_steps

SMALL_BUCKET = 8 << 10  # many buckets even for a tiny model
LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_dropout=0.0,
    init_lora_weights=False,
)


def build(family: str, seed: int = 0, **config) -> torch.nn.Module:
    if family == "qwen3_moe":
        tiny = tiny_config("qwen3_moe")
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny, dtype=torch.float32)
    return tiny_model(family, seed=seed, **config)


def saved(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What transformers' own save_pretrained writes for `model`."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        out = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            out.update(load_file(file))
        return out


def differences(got: dict, expected: dict, atol: float) -> list[str]:
    if sorted(got) != sorted(expected):
        return [f"names: {sorted(set(got) ^ set(expected))}"]
    return [
        n
        for n, t in expected.items()
        if got[n].shape != t.shape or got[n].dtype != t.dtype or not torch.allclose(got[n], t, atol=atol, rtol=0)
    ]


def export_family(rank: int, world: int, family: str, steps: int) -> dict:
    """Trains `steps` steps wrapped and in one process; exports; one more step each; compares."""
    ids = batch()
    plain = build(family)
    model = autotp.wrap(build(family), world)
    if steps:
        for m in (plain, model):
            train_steps(m, torch.optim.SGD(m.parameters(), lr=0.1), steps, input_ids=ids, labels=ids)
    exported = list(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
    report = {"yielded": len(exported)}
    if rank == 0:
        report["differ"] = differences(dict(exported), saved(plain), PARAM_ATOL)
        report["order"] = [n for n, _ in exported] == list(dict(exported))  # no name twice
    bf16 = dict(autotp.export_weights(model, dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKET))
    if rank == 0:
        report["bf16"] = differences(bf16, {n: t.bfloat16() for n, t in saved(plain).items()}, 1e-2)
    # the model is left as it was: one more step still matches one process
    losses = [
        train_steps(m, torch.optim.SGD(m.parameters(), lr=0.1), 1, input_ids=ids, labels=ids)[0] for m in (plain, model)
    ]
    report["loss"] = abs(losses[0] - losses[1])
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family,steps", [("llama", 2), ("qwen3_moe", 0), ("gemma", 1), ("phi3", 1)])
def test_export_equals_transformers_save(family: str, steps: int) -> None:
    """Llama after training, Qwen3-MoE (experts one tensor each), Gemma (tied), Phi-3 (fused qkv, gate_up); in fp32
    and bf16; then one more training step matches one process."""
    reports = run_ranks(export_family, 2, family, steps)
    assert reports[1]["yielded"] == 0
    assert reports[0]["yielded"] and reports[0]["order"]
    assert reports[0]["differ"] == [] and reports[0]["bf16"] == [], reports[0]
    assert all(r["loss"] <= 1e-5 for r in reports), reports


def from_files(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def trained_pair(family: str, world: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """One process and the same model at tp=`world`, each trained 1 step on the same batch."""
    ids = batch()
    plain, model = build(family), autotp.wrap(build(family), world)
    for m in (plain, model):
        train_steps(m, torch.optim.SGD(m.parameters(), lr=0.1), 1, input_ids=ids, labels=ids)
    return plain, model


def export_inside_gather(rank: int, world: int, family: str) -> dict:
    """export_weights and autotp.save_pretrained inside GatherReplacedLayerParams (the model holds full weights
    there), against one process's transformers save."""
    plain, model = trained_pair(family, world)
    with tempfile.TemporaryDirectory() as tmp, autotp.GatherReplacedLayerParams(model):
        exported = dict(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
        autotp.save_pretrained(model, tmp, overwrite=True)
        written = from_files(tmp) if rank == 0 else {}
    report = {"yielded": len(exported)}
    if rank == 0:
        expected = saved(plain)
        report["exported"] = differences(exported, expected, PARAM_ATOL)
        report["saved"] = differences(written, expected, PARAM_ATOL)
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_export_and_save_inside_gather_replaced_layer_params(family: str) -> None:
    """Inside the context every rank holds the full weights: they go out as they are, not cut again as shards
    (tolerance PARAM_ATOL: one SGD step on each side, fp32 reductions in another order)."""
    reports = run_ranks(export_inside_gather, 2, family)
    assert reports[1]["yielded"] == 0
    assert reports[0]["exported"] == [] and reports[0]["saved"] == [], reports[0]


def export_through_ddp(rank: int, world: int) -> dict:
    """export_weights and autotp.save_pretrained given the DDP around the model, as a training loop holds it."""
    from torch.nn.parallel import DistributedDataParallel

    from autotp.integrations.trainer import _TPOnly  # AutoTPTrainer's model_wrapped at dp=1 (DDP at dp > 1)

    plain, model = trained_pair("llama", world)
    ddp = DistributedDataParallel(model, process_group=autotp.dp_group(model))
    exported = dict(autotp.export_weights(ddp, bucket_bytes=SMALL_BUCKET))
    marked = dict(autotp.export_weights(_TPOnly(model), bucket_bytes=SMALL_BUCKET))
    with tempfile.TemporaryDirectory() as tmp:
        autotp.save_pretrained(ddp, tmp, overwrite=True)
        written = from_files(tmp) if rank == 0 else {}
    if rank:
        return {}
    expected = saved(plain)
    return {
        "exported": differences(exported, expected, PARAM_ATOL),
        "saved": differences(written, expected, PARAM_ATOL),
        "trainer": differences(marked, expected, PARAM_ATOL),
    }


@pytest.mark.timeout(120)
def test_export_and_save_through_ddp_use_the_model_names() -> None:
    """DDP's (and AutoTPTrainer's one-replica marker's) state-dict keys carry a `module.` prefix that no engine or
    transformers reads: the model's own names."""
    report = run_ranks(export_through_ddp, 2)[0]
    assert report == {"exported": [], "saved": [], "trainer": []}, report


def lora_model(world: int, before_wrap: bool, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model("llama")
    if world > 1 and before_wrap:
        peft_model = get_peft_model(model, LoraConfig(**LORA, **config))
        autotp.wrap(peft_model.base_model.model, world)
        return peft_model
    if world > 1:
        autotp.wrap(model, world)
    return get_peft_model(model, LoraConfig(**LORA, **config))


def export_lora(rank: int, world: int, before_wrap: bool) -> dict:
    ids = batch()
    config = {} if before_wrap else dict(modules_to_save=["lm_head"])  # wrap refuses a modules_to_save wrapper
    plain, model = lora_model(1, before_wrap, **config), lora_model(world, before_wrap, **config)
    for m in (plain, model):
        train_steps(
            m, torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1), 1, input_ids=ids, labels=ids
        )
    merged = dict(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
    base = dict(autotp.export_weights(model, merge_lora=False, bucket_bytes=SMALL_BUCKET))
    adapters = dict(autotp.export_adapters(model, bucket_bytes=SMALL_BUCKET))
    with torch.no_grad():  # the model still trains with its adapters: same forward as one process
        loss = abs(model(input_ids=ids, labels=ids).loss.item() - plain(input_ids=ids, labels=ids).loss.item())
    report = {"loss": loss, "merged_left": any("lora_A" in n for n, _ in model.named_parameters())}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            plain.save_pretrained(tmp)
            expected_adapters = load_file(Path(tmp) / "adapter_model.safetensors")
        unmerged = {n: t for n, t in saved(plain.get_base_model()).items()}
        report["base"] = differences(
            base,
            {
                n.replace(".base_layer", "").replace(".original_module", ""): t
                for n, t in unmerged.items()
                if "lora_" not in n and "modules_to_save" not in n
            },
            1e-5,
        )
        report["adapters"] = differences(adapters, expected_adapters, 1e-5)
        report["merged"] = differences(merged, saved(plain.merge_and_unload()), 1e-5)
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("before_wrap", [True, False], ids=["before-wrap", "after-wrap"])
def test_lora_merged_equals_merge_and_unload(before_wrap: bool) -> None:
    """merge_lora=True: merge_and_unload()'s save within 1e-5 (modules_to_save's copy under the base name);
    merge_lora=False: the base weights, and export_adapters PEFT's own adapter file; the model keeps training.
    (modules_to_save after wrap only: wrap refuses PEFT's wrapper already in the model.)"""
    reports = run_ranks(export_lora, 2, before_wrap)
    assert reports[0]["merged"] == [] and reports[0]["base"] == [] and reports[0]["adapters"] == [], reports[0]
    assert all(r["merged_left"] and r["loss"] <= 1e-5 for r in reports), reports


def export_tied_head_lora(rank: int, world: int, vocab_parallel: bool) -> list[str] | None:
    """Gemma (lm_head tied to the embedding) with LoRA on lm_head too, after wrap, against one process's
    merge_and_unload() save."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    plain, model = tiny_model("gemma"), autotp.wrap(tiny_model("gemma"), world, vocab_parallel=vocab_parallel)
    torch.manual_seed(1)
    plain = get_peft_model(plain, config)
    torch.manual_seed(1)
    model = get_peft_model(model, config)
    merged = dict(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
    return differences(merged, saved(plain.merge_and_unload()), 1e-5) if rank == 0 else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab_parallel", [True, False], ids=["vocab-parallel", "replicated-head"])
def test_lora_on_a_tied_head_merges_into_the_embedding(vocab_parallel: bool) -> None:
    """transformers saves the tied pair as model.embed_tokens.weight; merge_and_unload() merged the head's delta
    into that one shared tensor, so the export carries it there (1e-5: fp32 merge, one matmul per shard)."""
    assert run_ranks(export_tied_head_lora, 2, vocab_parallel)[0] == []


def stop_early(rank: int, world: int, how: str) -> str:
    model = autotp.wrap(tiny_model("llama"), world)
    exported = autotp.export_weights(model, bucket_bytes=SMALL_BUCKET)
    try:
        if rank == 0:
            if how == "break":
                for _ in exported:
                    break
                del exported
            else:
                next(exported)
                exported.close()
            return "stopped"
        for _ in exported:
            pass
    except RuntimeError as err:
        return str(err)
    return "finished"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["break", "close"])
def test_a_rank_stopping_early_makes_the_others_raise(how: str) -> None:
    reports = run_ranks(stop_early, 2, how)
    assert reports[0] == "stopped"
    assert "rank(s) [0] stopped iterating before the end" in reports[1], reports[1]


def interleaved(rank: int, world: int) -> dict:
    """Two identical exports zipped, then one more export alone: does the process still export right?"""
    model = autotp.wrap(tiny_model("llama"), world)
    try:
        for _ in zip(
            autotp.export_weights(model, bucket_bytes=SMALL_BUCKET),
            autotp.export_weights(model, bucket_bytes=SMALL_BUCKET),
        ):
            pass
        error = "finished"
    except RuntimeError as err:
        error = str(err)
    after = dict(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
    return {"error": error, "after": differences(after, saved(tiny_model("llama")), 0) if rank == 0 else after}


@pytest.mark.timeout(60)
def test_exports_interleaved_with_zip_raise_on_every_rank() -> None:
    """Rank 1 yields nothing, so its first next() runs a whole export while rank 0 is at the second one: every rank
    raises, naming it, before their gathers mismatch (gloo would abort the process); a later export still works."""
    for report in run_ranks(interleaved, 2):
        assert "the ranks are at different exports" in report["error"], report["error"]
        assert "rank 0 at export #1 bucket 0, rank 1 at export #0 bucket 1" in report["error"], report["error"]
        assert "Iterate one export to its end before the next" in report["error"]
        assert report["after"] in ([], {}), report["after"]


@pytest.mark.parametrize("call", ["export_weights", "export_adapters", "sync_weights"])
@pytest.mark.parametrize("bucket_bytes", [0, -1])
def test_bucket_bytes_must_be_positive(call: str, bucket_bytes: int) -> None:
    model = tiny_model("llama")
    args = {
        "export_weights": (model,),
        "export_adapters": (get_peft_model(model, LoraConfig(**LORA)),),
        "sync_weights": (model, None),
    }[call]
    with pytest.raises(
        ValueError,
        match=rf"autotp.{call}\(bucket_bytes={bucket_bytes}\): the bucket size must be "
        rf"a positive number of bytes",
    ):
        getattr(autotp, call)(*args, bucket_bytes=bucket_bytes)


def engine_slices(rank: int, world: int, engine_tps: list[int]) -> dict:
    """The trainer (tp=world): `target=` slices for each engine tp, from TP rank 0."""
    model = autotp.wrap(tiny_model("llama", num_key_value_heads=2), world)
    out = {}
    for tp in engine_tps:
        out[tp] = [
            (n, r, t)
            for n, r, t in autotp.export_weights(model, target=autotp.EngineLayout(tp), bucket_bytes=SMALL_BUCKET)
        ]
    return out


def engine_loads(rank: int, world: int, slices: list) -> list[str]:
    """A stand-in engine rank: a model wrapped at the engine's tp with other weights loads its slices; they must
    equal `wrap(model, engine_tp)`'s shards."""
    engine = autotp.wrap(tiny_model("llama", seed=5, num_key_value_heads=2), world)
    expected = autotp.wrap(tiny_model("llama", num_key_value_heads=2), world).state_dict()
    params = dict(engine.named_parameters())
    loaded = set()
    for name, engine_rank, rows in slices:
        if engine_rank == rank:
            with torch.no_grad():
                params[name].copy_(rows)
            loaded.add(name)
    bad = [n for n, p in params.items() if not torch.equal(p.detach(), expected[n])]
    return bad + [f"not sent: {n}" for n in sorted(set(params) - loaded)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine_tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_target_slices_equal_wrap_at_the_engine_tp(engine_tp: int) -> None:
    """Trainer tp=2; engine tp 1, 2, 4 (KV heads replicated at 4): each engine rank's slices load into a model
    wrapped at that tp and equal its shards; no full tensor is built for a sharded one."""
    slices = run_ranks(engine_slices, 2, [engine_tp])[0][engine_tp]
    names = {n for n, _, _ in slices}
    assert {r for _, r, _ in slices} == set(range(engine_tp))
    if engine_tp == 1:
        expected = tiny_model("llama", num_key_value_heads=2).state_dict()
        assert all(torch.equal(t, expected[n]) for n, _, t in slices) and names == set(expected)
        return
    for bad in run_ranks(engine_loads, engine_tp, slices):
        assert bad == [], bad


def trainer_syncs(rank: int, world: int, port: int, engines: int, tp: int, fsdp: bool, gathered: bool) -> int:
    """The trainer side as docs/rl.md writes it: one sender (TP rank 0 of DP replica 0), None everywhere else."""
    model = autotp.wrap(tiny_model("llama"), tp)
    if fsdp:
        model = autotp.fully_shard(model)
    group = None
    if autotp.tp_rank(model) == 0 and autotp.dp_rank(model) == 0:
        store = dist.TCPStore("127.0.0.1", port, engines + 1, True, timeout=datetime.timedelta(seconds=60))
        group = dist.ProcessGroupGloo(dist.PrefixStore("engine", store), 0, engines + 1, datetime.timedelta(seconds=60))
    with autotp.GatherReplacedLayerParams(model, enabled=gathered):
        autotp.sync_weights(model, group, bucket_bytes=SMALL_BUCKET)
    return rank


def engine_receives(rank: int, engines: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, engines + 1, False, timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("engine", store), rank, engines + 1, datetime.timedelta(seconds=60))
    received = {name: tensor.clone() for name, tensor in autotp.receive_weights(group)}
    torch.save(received, Path(out) / f"{rank}.pt")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world,tp,fsdp,gathered",
    [
        (2, 2, False, False),
        (2, 2, False, True),
        (2, 1, False, False),
        pytest.param(4, 2, False, False, marks=pytest.mark.slow),
        pytest.param(4, 2, True, False, marks=pytest.mark.slow),
    ],
    ids=["tp2", "tp2-inside-gather", "dp2", "tp2-dp2", "tp2-dp2-fully-shard"],
)
def test_sync_weights_reaches_stand_in_engines(tmp_path: Path, world: int, tp: int, fsdp: bool, gathered: bool) -> None:
    """2 engine processes outside the trainer's world share a gloo group (own TCPStore) with TP rank 0 of DP
    replica 0 and receive transformers' save of the model; the other replicas' TP rank 0 (given None, as
    docs/rl.md's call gives it) drain. Also inside GatherReplacedLayerParams, where the model holds full weights."""
    port, engines = free_port(), 2
    context = mp.get_context("fork")
    procs = [context.Process(target=engine_receives, args=(r, engines, port, str(tmp_path))) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        run_ranks(trainer_syncs, world, port, engines, tp, fsdp, gathered)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    expected = saved(tiny_model("llama"))
    for r in (1, 2):
        got = torch.load(tmp_path / f"{r}.pt")
        assert differences(got, expected, 0) == []


MEMORY_MODEL = dict(hidden_size=256, intermediate_size=1024, vocab_size=8192, head_dim=32)  # an 8 MiB embedding


def rss(field: str = "VmRSS") -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def export_peak(rank: int, world: int, bucket: int) -> dict:
    """Peak RSS above the start during an export whose consumer drops each tensor (VmHWM reset just before; large
    buffers mmapped, so a freed one leaves RSS at once)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: fixed, not raised by frees
    model = autotp.wrap(tiny_model("llama", **MEMORY_MODEL), world)
    for _ in autotp.export_weights(model, bucket_bytes=bucket):  # warm: first-call imports and caches
        pass
    largest = 0
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = rss()
    for _, tensor in autotp.export_weights(model, bucket_bytes=bucket):
        largest = max(largest, tensor.nbytes)
        del tensor  # as an engine's load_weights does: copy, then drop
    return {"peak": rss("VmHWM") - before, "largest": largest}


@pytest.mark.timeout(120)
def test_peak_memory_is_within_one_bucket_plus_one_tensor() -> None:
    """Measured on every rank at tp=2 with 1 MiB buckets: the bound is the bucket plus the largest tensor (8 MiB)."""
    bucket = 1 << 20
    reports = run_ranks(export_peak, 2, bucket)
    largest = reports[0]["largest"]
    assert largest == 8192 * 256 * 4
    for report in reports:
        assert report["peak"] <= bucket + largest, (report, bucket + largest)


def export_sharded_twice(rank: int, world: int, family: str, tp: int) -> dict:
    """Wrapped at `tp` over `world` ranks under fully_shard; 1 step (DDP-equal batches), export; vs one process."""
    ids = batch()
    plain = build(family)
    model = autotp.fully_shard(autotp.wrap(build(family), tp))
    for m in (plain, model):
        train_steps(m, torch.optim.SGD(m.parameters(), lr=0.1), 1, input_ids=ids, labels=ids)
    exported = dict(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
    return {"exported": exported, "plain": {n: p.detach().clone() for n, p in plain.named_parameters()}}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_export_under_fully_shard(family: str) -> None:
    """tp=2 x dp=2: TP rank 0 of each replica gets transformers' save; the others nothing."""
    reports = run_ranks(export_sharded_twice, 4, family, 2)
    assert [bool(r["exported"]) for r in reports] == [True, False, True, False]
    plain = build(family)  # transformers saves on global rank 0 only: its save of rank 0's one-process run, here
    plain.load_state_dict(reports[0]["plain"], strict=False)
    expected = saved(plain)
    for rank in (0, 2):
        assert differences(reports[rank]["exported"], expected, PARAM_ATOL) == [], rank


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_export_at_tp4(family: str) -> None:
    reports = run_ranks(export_family, 4, family, 1)
    assert reports[0]["differ"] == [] and reports[0]["bf16"] == [], reports[0]
    assert all(r["loss"] <= 1e-5 for r in reports), reports


def moe_engine_slices(rank: int, world: int, engine_tp: int) -> list:
    model = autotp.wrap(build("qwen3_moe"), world)
    return list(autotp.export_weights(model, target=autotp.EngineLayout(engine_tp), bucket_bytes=SMALL_BUCKET))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine_tp", [2, 4])
def test_target_cuts_experts_per_engine_rank(engine_tp: int) -> None:
    """Qwen3-MoE from a trainer at tp=2 to an engine at tp 2 and 4 (each expert's gate, up and down rows cut from the
    fused tensors; at 4, each engine rank's rows taken from inside one trainer rank's): the engine ranks' rows of
    each checkpoint tensor, side by side, are transformers' saved tensor; replicated tensors go whole to each."""
    slices = run_ranks(moe_engine_slices, 2, engine_tp)[0]
    expected = saved(build("qwen3_moe"))
    by_name: dict[str, list] = {}
    for name, engine_rank, rows in slices:
        by_name.setdefault(name, [None] * engine_tp)[engine_rank] = rows
    assert sorted(by_name) == sorted(expected)
    split = 0
    for name, held in by_name.items():
        full = expected[name]
        dims = [d for d in range(full.dim()) if held[0].shape[d] != full.shape[d]]
        if not dims:
            assert all(torch.equal(rows, full) for rows in held), name
            continue
        split += ".experts." in name
        distinct = [held[0]] + [rows for before, rows in zip(held, held[1:]) if not torch.equal(before, rows)]
        assert torch.equal(torch.cat(distinct, dim=dims[0]), full), name  # KV heads replicated at 4: held twice
    assert split >= 3 * 2, "the experts' gate, up and down are cut per engine rank"


def vllm_slices(rank: int, world: int) -> tuple[list, list]:
    """The trainer (tp=world, vocab 250): slices for vLLM at tp 4 and for `wrap` at tp 4."""
    model = autotp.wrap(tiny_model("llama", num_key_value_heads=2, vocab_size=250), world)
    return (
        [
            (n, r, t)
            for n, r, t in autotp.export_weights(model, target=autotp.EngineLayout.vllm(4), bucket_bytes=SMALL_BUCKET)
        ],
        [
            (n, r, t)
            for n, r, t in autotp.export_weights(model, target=autotp.EngineLayout(4), bucket_bytes=SMALL_BUCKET)
        ],
    )


@pytest.mark.timeout(180)
def test_vllm_target_cuts_the_vocabulary_as_vllm_pads_it() -> None:
    """Vocab 250 at engine tp 4: vLLM pads to 256 and gives each rank 64 rows (the last 58 real ones), where `wrap`
    gives 63/63/62/62; every other tensor gets `wrap`'s rows."""
    ours, wraps = run_ranks(vllm_slices, 2)[0]
    full = tiny_model("llama", num_key_value_heads=2, vocab_size=250).state_dict()
    vocab = {"lm_head.weight", "model.embed_tokens.weight"}
    for name in vocab:
        held = sorted((r, t) for n, r, t in ours if n == name)
        assert [t.shape[0] for _, t in held] == [64, 64, 64, 58], name
        assert torch.equal(torch.cat([t for _, t in held]), full[name]), name
        assert [t.shape[0] for n, _, t in sorted(wraps, key=lambda x: x[1]) if n == name] == [63, 63, 62, 62]
    rest = lambda slices: sorted(((n, r, t) for n, r, t in slices if n not in vocab), key=lambda x: x[:2])  # noqa
    assert all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(rest(ours), rest(wraps), strict=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["gpt_neox", "bloom", "falcon"])
def test_vllm_target_refuses_interleaved_fused_qkv_by_name(family: str) -> None:
    """vLLM reorders these models' per-head q/k/v into q|k|v before cutting; autotp does not produce those rows."""
    with pytest.raises(NotImplementedError, match="per-head interleaved fused q/k/v"):
        autotp.EngineLayout.vllm(2).partitions(tiny_model(family))
