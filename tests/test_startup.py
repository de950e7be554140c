"""What a start costs: the kernels are built ahead (`python -m tierserve.model.kernels`,
run by `make install`) and the step-time calibration is measured once per machine and
configuration, then read back."""

import subprocess
import sys

from tierserve.model import kernels


def test_kernel_build_command_says_one_line():
    done = subprocess.run([sys.executable, "-m", "tierserve.model.kernels"],
                          capture_output=True, text=True, timeout=600)
    if kernels.load() is None:
        assert done.returncode == 1 and "plain torch ops" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierserve: CPU kernels ready")


def test_calibration_is_measured_once_then_read_back(tmp_path, monkeypatch):
    from tierserve.engine.calibrate import cache_path
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path))
    config = dict(dtype="bfloat16", kv_cache_memory_gb=0.25, max_num_seqs=8)
    first, second = [], []
    a = LLMEngine(engine_config(**config), progress=first.append)
    path = cache_path(a)
    assert path.exists() and any("calibrating" in line for line in first)
    b = LLMEngine(engine_config(**config), progress=second.append)
    assert not any("calibrating" in line for line in second)
    assert any(str(path) in line for line in second)
    assert b.scheduler.step_time_model == a.scheduler.step_time_model
    assert b.scheduler.step_time_limit_s == a.scheduler.step_time_limit_s
    # another configuration is another file
    c = LLMEngine.__new__(LLMEngine)
    c.config, c.loaded, c.runner, c.max_model_len = (
        engine_config(**config | {"max_num_seqs": 16}), a.loaded, a.runner, a.max_model_len)
    assert cache_path(c) != path
