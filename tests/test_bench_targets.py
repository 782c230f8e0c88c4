"""``hawk bench`` says of each of its goals whether it was MET or MISSED, lists the missed ones
last, and exits 1 for a miss only under ``--strict``."""

import json

import pytest

from sim.bench import speed
from sim.commands.main import main


def _aggregated(num_instances: int, vs_pd: float, long_ratio: float) -> dict:
    return dict(num_instances=num_instances, requests_per_bare_event=0.05, wall_s=1.0,
                slo_attainment=0.99, wakeups_per_request=0.5, preemptions_per_request=0.0,
                disaggregated_wall_s=1.0 / vs_pd, per_request_vs_disaggregated=vs_pd,
                long_output_wall_s=long_ratio, long_output_wall_ratio=long_ratio,
                output_tokens=1000, long_output_output_tokens=10_000,
                long_output_per_token_ratio=long_ratio / 10,
                long_output_wakeups_per_request=0.3,
                per_repeat={"per_request_vs_disaggregated": [vs_pd, vs_pd * 1.1],
                            "long_output_wall_ratio": [long_ratio, long_ratio]})


def _report(per_event=0.07, long_ratio=1.2, startup=0.3, agg_vs_pd=(0.9, 0.95),
            agg_long=(1.1, 1.0)) -> dict:
    return dict(num_requests=10, rate=0.5, slo_attainment=1.0, repeats=1, wall_s=1.0,
                simulated_requests_per_s=10.0, bare_simpy_events_per_s=100.0,
                requests_per_bare_event=per_event, decode_wakeups_per_request=0.9,
                long_output_rate=0.05, long_output_wall_ratio=long_ratio,
                long_output_wall_s=long_ratio, long_output_same_rate_wall_ratio=3.0,
                long_output_same_rate_wall_s=3.0,
                long_output_same_rate_preemptions_per_request=1.4, startup_s=startup,
                startup_wall_s=0.4,
                aggregated=[_aggregated(k + 1, v, r)
                            for k, (v, r) in enumerate(zip(agg_vs_pd, agg_long))])


def _target_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "target" in line and "targets:" not in line]


def test_every_target_line_says_met_and_the_summary_says_all():
    text = speed.format_report(_report())
    lines = _target_lines(text)
    assert len(lines) == 7 and all(line.endswith("  MET") for line in lines)
    assert text.splitlines()[-1] == "  targets: all 7 met"
    assert speed.missed_targets(_report()) == []


def test_a_missed_target_is_named_on_its_line_and_in_the_summary():
    report = _report(per_event=0.0521, agg_vs_pd=(0.9, 1.24), agg_long=(2.5, 1.0))
    text = speed.format_report(report)
    missed = [line for line in _target_lines(text) if line.endswith("  MISSED")]
    assert [line.split()[0] for line in missed] == ["requests", "10x", "per"]
    assert "aggregated 2x A100 TP4" in text.split("1.24x CPU")[0].splitlines()[-2]
    assert text.splitlines()[-1] == (
        "  targets: 4 of 7 met; MISSED: requests per bare event 0.0521 (target >= 0.06); "
        "aggregated 1x 10x longer outputs 2.5 (target < 2x); "
        "aggregated 2x per request vs P/D 1.24 (target <= 1x)")


def test_the_goals_are_bounds_on_the_right_side():
    assert speed.missed_targets(_report(per_event=0.06, agg_vs_pd=(1.0, 1.0))) == []
    assert speed.missed_targets(_report(long_ratio=2.0, startup=0.5)) == [
        "10x longer outputs 2 (target < 2x)", "start-up to first event 0.5 (target < 0.5 s)"]


@pytest.mark.parametrize("strict, per_event, code", [(False, 0.01, 0), (True, 0.01, 1),
                                                     (True, 0.07, 0)])
def test_strict_exits_one_only_for_a_miss(monkeypatch, capsys, strict, per_event, code):
    def run(**kwargs):
        report = _report(per_event=per_event)
        report["targets_missed"] = speed.missed_targets(report)
        return report

    monkeypatch.setattr(speed, "run", run)
    argv = ["bench", "--num-requests", "10", "--memory-requests", "0"]
    assert main(argv + ["--json"] + (["--strict"] if strict else [])) == code
    out = json.loads(capsys.readouterr().out)
    assert out["targets_missed"] == ([] if per_event >= 0.06 else
                                     ["requests per bare event 0.01 (target >= 0.06)"])
    assert main(argv + (["--strict"] if strict else [])) == code
    assert ("MISSED" in capsys.readouterr().out) == (per_event < 0.06)
