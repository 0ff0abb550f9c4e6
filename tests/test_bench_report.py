"""The GPU benchmark's pipeline report (the numbers themselves come from the GPU machine)."""
from dataclasses import asdict


def test_pipeline_efficiency_compares_stages_with_the_bubble_bound():
    from pipetrain.bench.run import CASES, pipeline_efficiency

    results = {name: {"case": asdict(CASES[name]), "ours": {"samples_per_s": sps}}
               for name, sps in (("flux-1024-1stage-ga8", 2.0), ("flux-1024-2stages-ga8", 3.2), ("flux-1024", 2.4))}
    (line,) = pipeline_efficiency(results)
    assert line == ("flux-1024-2stages-ga8: 2 stages vs 1, GA 8: speed-up 1.60x, efficiency 80% "
                    "(bubble bound 89%)")
    del results["flux-1024-1stage-ga8"]        # nothing to compare with
    assert pipeline_efficiency(results) == []
