"""benchmarks/gpu.py --smoke: every section of the GPU benchmark runs at tiny sizes on CPU (the fake process group
included) and writes its JSON lines, each naming the versions and the device; the table is rebuilt from them.

No timing is asserted (tests never time things): the figures are for people to read.
"""

from __future__ import annotations

import json
import sys

import pytest

from readme_commands import ROOT, run

SCRIPT = str(ROOT / "benchmarks" / "gpu.py")


@pytest.mark.slow  # about a minute: eight sections, four of them in child processes
def test_smoke_run_writes_every_section(tmp_path) -> None:
    out = tmp_path / "gpu.jsonl"
    run([sys.executable, SCRIPT, "--smoke", "--sections", "abcdefgh", "--out", str(out)], timeout=240)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record in records:
        assert record["torch"] and record["transformers"] and record["gpu"] and record["device"], record
    assert not [r for r in records if r["kind"] in ("error", "timeout")], [r.get("reason") for r in records]
    by_section = {
        s: [r for r in records if r["section"] == s] for s in ("a", "b", "c", "d", "e", "f", "g", "h", "pytest")
    }
    for section, lines in by_section.items():
        assert any(r["kind"] in ("figure", "skip") for r in lines), f"section {section} wrote nothing: {records}"
    figures = {s: [r for r in lines if r["kind"] == "figure"] for s, lines in by_section.items()}
    for section in ("a", "b", "c", "f", "h"):
        for r in figures[section]:
            assert r["tokens_per_s_per_gpu"] > 0 and r["flops_per_token"] > 0 and "N =" in r["flops"], r
    plain, wrapped = figures["a"]
    assert "plain" in plain["run"] and "autotp.wrap" in wrapped["run"] and wrapped["goal"] == 0.97, figures["a"]
    assert any(r["kind"] == "skip" and r["run"] == "compiled" for r in by_section["a"])
    for section in ("b", "f"):  # PEFT alone and under autotp, each in a process of its own, with its memory
        assert len(figures[section]) == 2 and all(r["flops"].startswith("4N") for r in figures[section]), figures
        assert all("own process" in r["run"] and "step_peak" in r["memory_gib"] for r in figures[section]), figures
    assert sum("autotp.wrap" in r["run"] for r in figures["f"]) == 1, figures["f"]
    (rank,) = figures["c"]
    assert "tp=8, fake process group" in rank["run"] and rank["upper_bound"] and "upper bound" in rank["beside"]
    (stage,) = figures["h"]  # one pipeline stage's compute: the micro-batches' forwards and backwards, AdamW
    assert "pp 4 x tp=8" in stage["run"] and "fake process group" in stage["run"] and stage["upper_bound"], stage
    assert 0 < stage["pipeline_tokens_per_s_per_gpu"] < stage["tokens_per_s_per_gpu"] and "bubble" in stage["beside"]
    (cp,) = figures["d"]
    assert cp["passed"] and "varlen_reference" in cp["attention"] and "SDPA" in cp["attention"], cp
    assert "fake process group moves no data" in by_section["e"][0]["reason"]
    recipes = {r["recipe"] for r in figures["g"]}  # float8 where torchao is installed, else one line saying so
    assert recipes >= {"bf16", "tensorwise"} or "torchao is not installed" in by_section["g"][0]["reason"], records
    table = out.with_suffix(".md").read_text()
    assert "| section | run | tokens/s per GPU | MFU | beside |" in table, table
    assert run([sys.executable, SCRIPT, "--table-from", str(out)], timeout=60) == table
