"""benchmarks/side_by_side.py --rounds: servers measured several times in alternating
order, and the medians and ratios it prints from the rounds."""

import socket

import pytest

from conftest import load_benchmark


def _bench():
    return load_benchmark("side_by_side")


def _res(c, tok_s, ttft_p99=1000.0, itl_p99=40.0, ok=128):
    return {"concurrency": c, "ok": ok, "requests": 128, "output_tok_s": tok_s,
            "ttft_ms_p99": ttft_p99, "itl_ms_p99": itl_p99}


def test_the_summary_takes_medians_over_rounds_and_ratios_against_the_first_server():
    rounds = [
        {"a": [_res(64, 690.0, 4600.0)], "b": [_res(64, 470.0, 5100.0)]},
        {"a": [_res(64, 640.0, 5300.0)], "b": [_res(64, 460.0, 5300.0)]},
        {"a": [_res(64, 700.0, 4500.0)], "b": []},           # b failed to start this round
    ]
    lines = _bench().summary(["a", "b"], [64], rounds)
    assert lines[0] == ("side_by_side_median server=a c=64 rounds=3 tok_s=690.00 "
                        "ttft_ms_p99=4600.0 itl_ms_p99=40.00")
    assert lines[1] == ("side_by_side_median server=b c=64 rounds=2 tok_s=465.00 "
                        "ttft_ms_p99=5200.0 itl_ms_p99=40.00")
    # medians' ratio, and only the rounds where both have a figure
    assert lines[2] == "side_by_side_ratio c=64 a/b tok_s=1.484 per_round=1.468,1.391"


def test_a_level_whose_requests_all_failed_is_left_out():
    rounds = [{"a": [_res(16, 480.0), _res(64, 0.0, ok=0)], "b": [_res(16, 320.0)]}]
    lines = _bench().summary(["a", "b"], [16, 64], rounds)
    assert [line.split()[0] for line in lines] == [
        "side_by_side_median", "side_by_side_median", "side_by_side_ratio"]
    assert "c=64" not in " ".join(lines)


def test_rounds_alternate_the_order_and_keep_each_rounds_logs(tmp_path, capsys):
    """Servers that exit at start-up are reported in every round, the next one is still
    started, and the exit status says some were not measured."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    rc = _bench().main(["--rounds", "2", "--concurrency", "1", "--logs", str(tmp_path),
                        "--server", f"first|{ports[0]}|exit 3",
                        "--server", f"second|{ports[1]}|exit 4"])
    out = capsys.readouterr().out
    assert rc == 1
    started = [line.split(":")[0] for line in out.splitlines()
               if line.startswith("# first:") or line.startswith("# second:")]
    assert started == ["# first", "# second", "# second", "# first"]
    assert out.count("FAILED: RuntimeError: server exited with") == 4
    assert (tmp_path / "round-1" / "first.log").exists()
    assert (tmp_path / "round-2" / "second.log").exists()
    assert "not measured: first, second" in out


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--rounds", "0"])
    assert exc.value.code == 2
