"""The simulator's hybrid comparison (`tierserve plan --hybrid`): the workload, the split
into pools, and the comparison's arithmetic."""

from tierserve.cli import main
from tierserve.model.shapes import preset
from tierserve.sim.hybrid import HARD_OUTPUT, SIMPLE_OUTPUT, compare, hybrid_workload


def test_the_workload_labels_hard_turns_long_and_arrives_in_order():
    items = hybrid_workload(400, rate=10, seed=3)
    hard = [r for r, h in items if h]
    simple = [r for r, h in items if not h]
    assert 0.2 < len(hard) / len(items) < 0.4
    assert all(HARD_OUTPUT[0] <= r.output_tokens <= HARD_OUTPUT[1] for r in hard)
    assert all(SIMPLE_OUTPUT[0] <= r.output_tokens <= SIMPLE_OUTPUT[1] for r in simple)
    assert sum(r.prompt_tokens for r in hard) / len(hard) > \
        sum(r.prompt_tokens for r in simple) / len(simple)
    times = [r.arrival_s for r, _ in items]
    assert times == sorted(times)


def test_the_hybrid_fleet_is_the_sum_of_its_pools_each_meeting_its_slo():
    slo = {"priority": (1.0, 0.1), "default": (10.0, 0.5)}
    c = compare(preset("llama-3-8b"), preset("llama-3.2-1b"), "h100-sxm", "l4", slo,
                n=300, rate=20, seed=1, max_replicas=4, max_num_seqs=[64],
                budgets=[2048])
    assert c.hybrid_per_hour == c.small.cost_per_hour + c.large.cost_per_hour
    assert c.small.cell.hardware == "l4" and c.large.cell.hardware == "h100-sxm"
    assert min(c.small.attainment.values()) >= 0.9
    assert min(c.large.attainment.values()) >= 0.9
    assert c.per_1k(c.all_large.cost_per_hour) > 0


def test_plan_hybrid_prints_both_fleets(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--hybrid", "llama-3.2-1b", "--hardware",
                 "h100-sxm", "--hybrid-hardware", "l4", "--slo", "priority=1,0.1",
                 "--slo", "default=10,0.5", "--hybrid-requests", "200", "--hybrid-rate",
                 "10", "--max-replicas", "3", "--max-num-seqs", "64"]) == 0
    out = capsys.readouterr().out
    assert "all llama-3-8b in the priority tier" in out
    assert "hybrid is" in out or "hybrid costs" in out  # cheaper, or more and why


def test_plan_hybrid_needs_both_slos(capsys):
    assert main(["plan", "--hybrid", "llama-3.2-1b", "--slo", "priority=1,0.1"]) == 1
    assert "--slo default" in capsys.readouterr().err
