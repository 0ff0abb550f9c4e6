"""bench/multi_gpu.py's arithmetic and planning (the runs themselves: tests/ranks/test_bench_multi_gpu_runs.py)."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from pipetrain.bench import multi_gpu as mg


def test_the_bubble_bound_is_the_share_of_slots_a_stage_computes():
    assert mg.bubble_bound(1, 8) == 1.0
    assert mg.bubble_bound(2, 8) == pytest.approx(8 / 9)
    assert mg.bubble_bound(4, 16) == pytest.approx(16 / 19)
    assert mg.bubble_bound(4, 8) == pytest.approx(8 / 11)


def test_efficiency_is_the_speed_up_over_the_bubble_bounded_ideal():
    two = mg.efficiency(3.2, 2.0, stages=2, micro_batches=8, data_parallel=1)
    assert two["speedup"] == pytest.approx(1.6)
    assert two["ideal_speedup"] == pytest.approx(16 / 9)
    assert two["efficiency"] == pytest.approx(0.9) and two["gpus"] == 2
    four = mg.efficiency(2.0, 1.0, stages=4, micro_batches=8, data_parallel=1)   # ideal 32/11 = 2.91
    assert four["efficiency"] == pytest.approx(2.0 * 11 / 32) and not four["target_met"]
    dp = mg.efficiency(7.6, 2.0, stages=1, micro_batches=8, data_parallel=4)     # linear: 4x
    assert (dp["ideal_speedup"], dp["efficiency"], dp["target_met"]) == (4.0, pytest.approx(0.95), True)
    both = mg.efficiency(6.0, 2.0, stages=2, micro_batches=8, data_parallel=2)   # 2 x 2 x 8/9
    assert both["ideal_speedup"] == pytest.approx(32 / 9) and both["gpus"] == 4


def test_scaling_compares_each_run_with_one_gpu_at_the_same_accumulation():
    from dataclasses import asdict

    cases = {name: {"case": asdict(case), "samples_per_s": sps} for name, case, sps in (
        ("flux-1024-1stage-ga8", mg.flux(1, 8), 2.0), ("flux-1024-2stages-ga8", mg.flux(2, 8), 3.2),
        ("flux-1024-1stage-ga16", mg.flux(1, 16), 2.1), ("flux-1024-2stages-ga16", mg.flux(2, 16), 3.9),
        ("flux-1024-dp2-ga8", mg.flux(1, 8, 2), 3.9), ("flux-1024-4stages-ga8", mg.flux(4, 8), None))}
    cases["equiv-stages"] = {"tolerance": {}, "passed": True}
    out = mg.scaling(cases)
    assert set(out) == {"flux-1024-2stages-ga8", "flux-1024-2stages-ga16", "flux-1024-dp2-ga8"}
    assert out["flux-1024-2stages-ga16"]["speedup"] == pytest.approx(3.9 / 2.1)      # against GA 16's one GPU
    assert out["flux-1024-2stages-ga16"]["efficiency"] == pytest.approx(3.9 / 2.1 / (2 * 16 / 17))
    assert out["flux-1024-dp2-ga8"]["efficiency"] == pytest.approx(3.9 / 4.0)
    del cases["flux-1024-1stage-ga8"]                                                 # nothing to compare with
    assert set(mg.scaling(cases)) == {"flux-1024-2stages-ga16"}


def test_differences_of_losses_and_loras(tmp_path):
    assert mg.differences([1.0, 2.0], [1.0, 2.02]) == (pytest.approx(0.02), pytest.approx(0.01))
    assert mg.differences([1.0], [1.0, 2.0]) == (math.inf, math.inf)
    assert mg.differences([1.0, math.nan], [1.0, math.nan]) == (math.inf, math.inf)
    a = {"x.lora_A.weight": torch.tensor([[1.0, -4.0]]), "x.lora_B.weight": torch.tensor([[0.5], [0.0]])}
    b = {"x.lora_A.weight": torch.tensor([[1.0, -4.1]]), "x.lora_B.weight": torch.tensor([[0.5], [0.001]])}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    d = mg.lora_differences(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert d["lora_max_abs"] == pytest.approx(0.1, rel=1e-5)
    assert d["lora_max_rel"] == pytest.approx(0.1 / 4.0, rel=1e-5)        # A's 0.1 of its 4.0 beats B's 0.001 of 0.5
    assert d["lora_moved"] and d["lora_tensors"] == 2
    save_file({"y.lora_A.weight": torch.zeros(1)}, str(tmp_path / "c.safetensors"))
    assert mg.lora_differences(tmp_path / "a.safetensors", tmp_path / "c.safetensors")["lora_max_rel"] == math.inf


def test_the_plan_runs_cases_in_order_of_value_and_skips_what_the_machine_cannot():
    two = mg.plan(2, [], [])
    names = [j.name for j, _ in two]
    assert names[:5] == ["equiv-stages", "equiv-dp", "flux-1024-1stage-ga8", "flux-1024-2stages-ga8",
                         "flux-1024-dp2-ga8"]
    assert not any(j.heavy for j, _ in two)                                   # heavy cases only when asked for
    skipped = {j.name: why for j, why in two if why}
    assert skipped["flux-1024-4stages-ga8"] == "needs 4 GPUs, 2 here" and "flux-1024-2stages-ga8" not in skipped
    heavy = {j.heavy: (j, why) for j, why in mg.plan(2, [], ["flux2", "wan14b"]) if j.heavy}
    assert heavy["flux2"][1] == "needs 4 GPUs, 2 here"                        # 32B weights + AdamW: 4 GPUs or more
    assert heavy["wan14b"][1] is None and heavy["wan14b"][0].case.stages == 2
    eight = {j.heavy: j for j, _ in mg.plan(8, [], ["flux2", "wan14b"]) if j.heavy}
    assert eight["flux2"].case.stages == 8 and eight["flux2"].case.full_finetune
    assert (eight["wan14b"].case.stages, eight["wan14b"].case.frames, eight["wan14b"].case.resolution) == (4, 81, 960)
    assert [j.name for j, _ in mg.plan(2, ["flux-1024-dp2-ga8", "equiv-dp"], [])] == ["equiv-dp", "flux-1024-dp2-ga8"]
    with pytest.raises(SystemExit, match="unknown case"):
        mg.plan(2, ["flux-1024-3stages"], [])


def test_a_spent_budget_starts_no_case_and_still_writes_the_report(tmp_path):
    rc = mg.main(["--device", "cpu", "--gpus", "2", "--budget-s", "0", "--out", str(tmp_path / "out"),
                  "--work", str(tmp_path / "work"), "--cases", "equiv-stages,flux-1024-4stages-ga8"])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "multi_gpu.json").read_text())
    assert report["cases"]["equiv-stages"]["skipped"].startswith("budget: ")
    assert report["cases"]["flux-1024-4stages-ga8"]["skipped"] == "needs 4 GPUs, 2 here"
    text = (tmp_path / "out" / "multi_gpu.md").read_text()
    assert "| flux-1024-4stages-ga8 | 4 | - | - | - | skipped: needs 4 GPUs, 2 here |" in text


def test_heavy_cases_free_the_other_full_size_models_only(tmp_path):
    for name in ("flux-full", "flux2-full", "wan-full", "flux-micro", "flux2-1024-fullft-8stages-ga8"):
        (tmp_path / name).mkdir()
    for name in ("flux-full.json", "flux2-full.json"):
        (tmp_path / name).write_text("{}")
    assert sorted(mg.free_disk_for(tmp_path, "wan-full")) == ["flux-full", "flux-full.json", "flux2-full",
                                                             "flux2-full.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux-micro", "flux2-1024-fullft-8stages-ga8", "wan-full"]


def test_reports_of_several_calls_merge_into_one_with_the_efficiencies_recomputed(tmp_path):
    from dataclasses import asdict

    def report(name, case, sps):
        return {"gpus": 2, "device": "cuda", "size": "full", "budget_s": 520, "gpu_names": ["H100"], "wall_s": 500,
                "cases": {name: {"gpus": case.stages, "case": asdict(case), "samples_per_s": sps, "rc": 0}}}
    (tmp_path / "a.json").write_text(json.dumps(report("flux-1024-1stage-ga16", mg.flux(1, 16), 2.0)))
    (tmp_path / "b.json").write_text(json.dumps(report("flux-1024-2stages-ga16", mg.flux(2, 16), 3.4)))
    assert mg.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert set(merged["cases"]) == {"flux-1024-1stage-ga16", "flux-1024-2stages-ga16"} and merged["wall_s"] == 1000
    assert merged["scaling"]["flux-1024-2stages-ga16"]["efficiency"] == pytest.approx(1.7 / (2 * 16 / 17))
