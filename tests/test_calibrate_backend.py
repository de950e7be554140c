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
