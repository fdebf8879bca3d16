"""benchmarks/gpu_engine.py --smoke: the H200 script runs end to end on the CPU at tiny sizes, and its references
agree with the engine where fp32 says they must (so the script cannot rot before the GPU run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"


def test_smoke_run_measures_every_section_against_its_reference(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--out", str(tmp_path), "--prefill-variants", "128x64w8s3+swiglu_persistent"]) == 0
    r = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert all("error" not in s and "skipped" not in s for s in r["sections"].values()), r["sections"]
    assert r["throughput"]["output_tokens"] == r["throughput"]["workload"]["output_tokens"]
    for name, d in r["decode"].items():  # the gpt-fast-style reference decodes the engine's tokens (fp32)
        assert d["compared"] == 24 and d["greedy_tokens_identical"] == 24, name
        assert d["ratio"] == pytest.approx(d["ours_tok_s"] / d["reference_tok_s"])
        assert d["ours_steps_timed"] == d["ours_decode_tokens"]  # a timed step is one token at batch 1
        # half the steps (rounded up) take at least the median step, so the loop takes at least that many medians:
        # the median step's rate is at least the mean rate x ceil(n/2) / n
        n = d["ours_steps_timed"]
        assert d["ours_median_step_tok_s"] >= d["ours_tok_s"] * ((n + 1) // 2) / n
        # the reference's steps likewise (timed by the marks between its steps: the host's clock on the CPU)
        m = d["reference_decode_tokens"]
        assert d["reference_median_step_tok_s"] >= d["reference_tok_s"] * ((m + 1) // 2) / m * 0.99
        assert d["median_step_ratio"] == pytest.approx(d["ours_median_step_tok_s"] / d["reference_median_step_tok_s"])
    assert set(r["prefill"]) == {"tiny-llama", "tiny-qwen3"}
    for name, pre in r["prefill"].items():  # HF's forward picks the engine's token
        assert pre["first_tokens_identical"] == 2 and not pre["truncated"], name
        tile = pre["prefill_variants"]["128x64w8s3+swiglu_persistent"]  # the engine again with prefill levers
        assert tile["first_tokens_identical_to_default"] == tile["prompts_timed"] == 4, name
    assert set(r["throughput"]["prefill_variants"]) == {"128x64w8s3+swiglu_persistent"}
    fix = r["prefix"]
    # 2 system prompts of 64 tokens then 32 unique ones, 3 waves: waves 2 and 3 hit 64 of 96 tokens
    assert fix["hit_share"] == pytest.approx(2 * 2 * 64 / (6 * 96))
    assert fix["first_tokens_identical"] == fix["requests"] == 6
    assert {"prefill", "decode"} <= set(r["profile"]["profile"])
    out = capsys.readouterr().out
    assert "measurement" in out and "(d) saved prefill time / hit share" in out


def test_an_unknown_prefill_variant_is_refused_in_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--out", str(tmp_path), "--prefill-variants", "128x64w8s3,swiglu_off+128x64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--prefill-variants: '128x64' (in 'swiglu_off+128x64') is neither a lever (swiglu_off, "
                          "swiglu_tiled, swiglu_persistent) nor a tile: NANOFORGE_ATTN_PREFILL_TILE must be")
    assert "\n" not in err and not (tmp_path / "gpu_engine.json").exists()


def load_steps_script():
    spec = importlib.util.spec_from_file_location("gpu_engine_steps", SCRIPT.with_name("gpu_engine_steps.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_device_timeline_splits_a_step_into_kernels_and_gaps():
    """gpu_engine_steps.timeline: overlapping kernels count once, gaps under the threshold are launch gaps, longer
    ones the device waiting for the host; all per step."""
    mod = load_steps_script()
    t = mod.timeline([(0, 10), (5, 20), (25, 30), (130, 140)], steps=2, step_gap_us=20)
    assert t["busy_us_per_step"] == (20 + 5 + 10) / 2
    assert t["short_gaps_us_per_step"] == 5 / 2 and t["long_gaps_us_per_step"] == 100 / 2
    assert t["span_us_per_step"] == 140 / 2 and t["kernels_per_step"] == 2


def test_the_steps_section_runs_on_the_cpu_and_drains_like_c(tmp_path):
    """--smoke --only steps: every pass's steps, and the drained pass gpu_engine.py's (c) is measured like."""
    mod = load_steps_script()
    assert mod.main(["--smoke", "--only", "steps", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "diag.json").read_text())
    assert all(d[f"{kind}_pass{p}"] for kind in ("eager", "graphed") for p in range(3))
    assert all(d[f"{kind}_step_kernels"] and "eager_step_device" in d for kind in ("eager", "graphed"))
    assert d["graphed_timeline"]["steps"] >= 1 and d["graphed_timeline"]["wall_ms"] > 0


def test_a_stalled_decode_run_is_named_by_its_mean_against_its_median_step():
    spec = importlib.util.spec_from_file_location("gpu_engine", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = {"ours_tok_s": 1060.0, "ours_median_step_tok_s": 1225.0,  # session 48's Qwen3 default, its median assumed
         "variants": {"again": {"tok_s": 1222.0, "median_step_tok_s": 1230.0}},
         "reference_tok_s": 820.0, "reference_median_step_tok_s": 824.0}
    assert mod.stalls(r) == [("ours", 1060.0, 1225.0)]
    r["ours_tok_s"] = 1200.0
    assert mod.stalls(r) == []
    r["reference_tok_s"] = 700.0  # the reference's loop stalls too (sessions 46-49: 643-822 on H100s)
    assert mod.stalls(r) == [("the reference", 700.0, 824.0)]
