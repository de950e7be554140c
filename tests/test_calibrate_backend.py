"""`tierserve calibrate --backend URL`: a replica's step-time model from its streamed
timings (router/calibrate.py), against a real server on loopback."""

import subprocess
import sys

import pytest

from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError
from tierserve.router.calibrate import calibrate_backend, grid


def test_the_grid_keeps_within_the_replicas_limits():
    prefills, decodes = grid(300, 8)
    assert prefills == [16, 64, 256]
    assert decodes == [(1, 64), (4, 64), (8, 64)]


def test_a_served_model_is_timed_and_fitted(tmp_path):
    from test_server import LiveServer
    from tierserve.server.settings import ServerSettings

    srv = LiveServer(ServerSettings())
    try:
        model, info = calibrate_backend(srv.url, repeats=1, prefills=[16, 64, 256],
                                        decodes=[(1, 64), (4, 64), (8, 64), (4, 256)])
    finally:
        srv.stop()
    assert info["model"] == "smol" and info["kind"] == "tierserve"
    assert info["records"] == 7
    # what the client saw is what the fit predicts, within the spread of a busy machine
    assert info["median_error"] < 0.35
    one, eight = model.predict_s([(1, 80)]), model.predict_s([(1, 80)] * 8)
    assert 0 < one < eight
    assert model.predict_s([(256, 256)]) > model.predict_s([(16, 16)])
    assert model.per_chunk_s == 0  # lone prefills cannot tell it from per_token
    model.save(tmp_path / "p.json", backend=info["url"])        # what `sim` reads back
    assert StepTimeModel.load(tmp_path / "p.json") == model


def test_an_unreachable_backend_and_engine_flags_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="did not answer"):
        calibrate_backend("http://127.0.0.1:9")
    out = subprocess.run([sys.executable, "-m", "tierserve.cli", "calibrate", "--backend",
                          "http://127.0.0.1:9", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "--dtype describes an engine run here" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_step_log_times_a_step_from_the_one_before_or_after_idle_from_its_start():
    """A record's time runs from the previous step's end where the step followed it back
    to back (the server's turn between steps is in it, however long), else from its own
    start; each record names its engine and model, a step naming no model taken as the
    server's."""
    from tierserve.core.stats import SeqStepStats, StepStats
    from tierserve.core.step_log import StepLog

    def step(start, duration, follows=None, engine="0", model=None, seqs=((1, 100),)):
        return StepStats(0, start, duration, len(seqs), 0, len(seqs), 0, 0.0, 0,
                         [SeqStepStats("r", n, c, n == 1) for n, c in seqs], engine=engine,
                         model=model, follows=follows)
    log = StepLog("smol", keep=8)
    log.on_step(step(10.0, 0.006, seqs=((200, 200),)))      # the first, after idle
    log.on_step(step(10.020, 0.006, 10.006, seqs=((1, 201), (64, 64))))  # a 14 ms turn
    log.on_step(step(10.530, 0.006))                        # after idle: its own time
    log.on_step(step(10.0025, 0.002, 10.002, engine="fast"))
    log.on_step(step(10.0, 0.002, model="gemma"))
    got, last = log.after(0)
    assert [(r["engine"], r["model"], r["seqs"], r["after_idle"]) for r in got] == [
        ("0", "smol", [[200, 200]], True), ("0", "smol", [[1, 201], [64, 64]], False),
        ("0", "smol", [[1, 100]], True), ("fast", "smol", [[1, 100]], False),
        ("0", "gemma", [[1, 100]], True)]
    assert [r["seconds"] for r in got] == pytest.approx([0.006, 0.020, 0.006, 0.0025, 0.002])
    assert last == 5 and log.after(got[2]["id"]) == (got[3:], 5)
    for i in range(5):                                      # only the newest `keep` are kept
        log.on_step(step(10.0045 + 0.002 * i, 0.002, 10.0045 + 0.002 * (i - 1),
                         engine="fast"))
    assert [r["id"] for r in log.after(0)[0]] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert log.last_id == 10


def test_a_replica_is_fitted_from_the_steps_it_recorded_while_serving(tmp_path):
    """GET /tierserve/v1/steps gives a tierserve replica's recent steps; `calibrate
    --backend URL --from-steps` fits them (the chunk term too, as prompt chunks ran beside
    decodes) without a timing grid, then measures the way in with one-token probes (not
    where other traffic runs); too few records, or a replica that keeps none, are refused
    with what to do."""
    import concurrent.futures
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from test_server import LiveServer
    from tierserve.core.step_time import load_way_in_s
    from tierserve.router.calibrate import (MIN_STEP_RECORDS, calibrate_from_steps,
                                            measure_way_in)
    from tierserve.server.settings import ServerSettings

    srv = LiveServer(ServerSettings())
    try:
        with pytest.raises(ConfigError, match=f"fewer than {MIN_STEP_RECORDS}; send the replica"):
            calibrate_from_steps(srv.url)

        def one(i):
            time.sleep(0.5 if i == 4 else 0)   # the last one's prompt beside the decodes
            return httpx.post(srv.url + "/v1/completions", timeout=300, json={
                "model": "smol", "prompt": [100 + i + j for j in range(40 + 60 * i)],
                # and its last 40 tokens alone, however the others' steps fell
                "max_tokens": 80 + 40 * (i == 4), "ignore_eos": True, "temperature": 0})
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            assert all(r.status_code == 200 for r in pool.map(one, range(5)))
        steps = httpx.get(srv.url + "/tierserve/v1/steps").json()
        data = steps["data"]
        assert len(data) >= MIN_STEP_RECORDS   # ids in order, none missing
        assert [r["id"] for r in data] == list(range(data[0]["id"], data[-1]["id"] + 1))
        assert all(r["seconds"] > 0 and r["seqs"] for r in data)
        assert all(0 < n <= c for r in data for n, c in r["seqs"])
        assert any(len(r["seqs"]) > 1 and max(n for n, _ in r["seqs"]) > 1 for r in data)
        assert httpx.get(srv.url + "/tierserve/v1/steps",
                         params={"after": steps["last_id"]}).json()["data"] == []
        bad = httpx.get(srv.url + "/tierserve/v1/steps", params={"after": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
        said = []
        model, info = calibrate_from_steps(srv.url, say=said.append)
        assert info["records"] == len(data) and info["kind"] == "tierserve"
        # then one-token probes of the idle replica: the way in outside its steps
        assert 0 <= info["way_in_s"] < 0.5, said
        assert any("the way in" in line and "median of 8 probes" in line for line in said)
        # the last request's last tokens decode alone: the fit's lone decode is theirs,
        # within a busy machine's spread (their median, of 40 or so)
        lone = sorted(r["seconds"] for r in data if r["seqs"] == [[1, r["seqs"][0][1]]])
        assert len(lone) >= 40
        assert model.predict_s([(1, 380)]) == pytest.approx(lone[len(lone) // 2], rel=0.5)
        out = subprocess.run([sys.executable, "-m", "tierserve.cli", "calibrate", "--backend",
                              srv.url, "--from-steps", "--out", str(tmp_path / "s.json")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert StepTimeModel.load(tmp_path / "s.json").predict_s([(1, 150)]) > 0
        assert 0 <= load_way_in_s(tmp_path / "s.json") < 0.5   # what `sim` adds
        assert "the way in" in out.stdout
        # with other traffic on the replica the probes' steps cannot be told apart
        busy = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                kwargs={"timeout": 300, "json": {
                                    "model": "smol", "prompt": "a long story", "max_tokens": 300,
                                    "ignore_eos": True}})
        busy.start()
        time.sleep(0.3)
        said.clear()
        assert measure_way_in(info, said.append) is None
        assert "the way in not measured" in said[0] and "--way-in-s" in said[0]
        busy.join(300)
        bad = subprocess.run([sys.executable, "-m", "tierserve.cli", "calibrate", "--backend",
                              srv.url, "--from-steps", "--repeats", "3"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "--from-steps sends no grid" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    finally:
        srv.stop()

    class Vllm(BaseHTTPRequestHandler):   # a replica that keeps no step records
        def do_GET(self):
            found = self.path == "/v1/models"
            body = b'{"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 512}]}'
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(body if found else b"{}")

        def log_message(self, *args):
            pass

    plain = ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="keeps no step records .* answered 404"):
            calibrate_from_steps(f"http://127.0.0.1:{plain.server_address[1]}")
    finally:
        plain.shutdown()
        plain.server_close()
