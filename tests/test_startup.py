"""What a start costs: the kernels are built ahead (`python -m tierserve.model.kernels`,
run by `make install`) and the step-time calibration is measured once per machine and
configuration, then read back."""

import os
import subprocess
import sys

import pytest

from tierserve.errors import ConfigError
from tierserve.model import kernels


def test_kernel_build_command_says_one_line():
    """Where a C++ compiler and ninja are there, the kernels build on this CPU whatever its
    instruction set (a source that compiled only with AVX-512 VNNI fell back to plain
    torch ops on a Zen 3, and every kernel test skipped as if no compiler were there);
    without them the command says so in one line."""
    import shutil

    from torch.utils.cpp_extension import is_ninja_available

    done = subprocess.run([sys.executable, "-m", "tierserve.model.kernels"],
                          capture_output=True, text=True, timeout=600)
    toolchain = shutil.which(os.environ.get("CXX", "c++")) is not None and \
        is_ninja_available() and not os.environ.get("TIERSERVE_NO_KERNELS")
    if kernels.load() is None:
        assert not toolchain, done.stderr[-3000:]
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


def test_tokenizer_read_back_from_the_cache_is_the_same(tmp_path, monkeypatch, default_model_path):
    """A GGUF tokenizer is built once and saved; the saved one must tokenize, template and
    name special tokens exactly as the one built from the file."""
    from tierserve.model.tokenizer import Tokenizer

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path))
    built = Tokenizer(default_model_path)
    assert list((tmp_path / "tokenizers").iterdir())
    cached = Tokenizer(default_model_path)
    text = "Hello wörld! <|im_start|> 12345 def f(x):\n\treturn x**2  🙂"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert cached.encode(text) == built.encode(text)
    assert cached.apply_chat_template(messages) == built.apply_chat_template(messages)
    assert (cached.eos_token_id, cached.vocab_size, cached.all_special_ids) == \
        (built.eos_token_id, built.vocab_size, built.all_special_ids)
    ids = built.encode(text)
    assert cached.decode(ids) == built.decode(ids)


def test_every_decode_batch_of_the_calibration_grid_is_measured_at_full_size(tmp_path,
                                                                            monkeypatch):
    """With the decode cap on (the default), prefill chunks enter more slowly than the
    step budget allows; each batch still gets its full-size decode steps, so the KV-token
    term is fitted on large batches at a long context, not on batches of 1-4 alone."""
    from tierserve.engine.calibrate import calibrate, calibration_batches
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.tiers import Tier

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(engine_config(dtype="bfloat16", kv_cache_memory_gb=0.25, max_num_seqs=8))
    assert engine.scheduler.step_time_model is not None  # the cap is on
    steps = []
    calibrate(engine, steps=steps)
    assert all(seconds > 0 for _, seconds in steps)
    for num, prompt_len, want in calibration_batches(engine.scheduler.max_seqs(Tier.DEFAULT),
                                                     engine.max_model_len):
        if want:  # decodes of `num` sequences, all at this batch's context (the grid's two
            got = sum(1 for seqs, _ in steps if len(seqs) == num  # are 352 tokens apart)
                      and all(n == 1 and prompt_len < c <= prompt_len + 300 for n, c in seqs))
            assert got >= want, (num, prompt_len, got, want)
    assert not engine.has_unfinished_requests()


def test_an_engine_with_a_priority_reserve_calibrates_at_start_up(tmp_path, monkeypatch):
    """Under the tiered policy the grid's default-tier requests get the context and the
    slots outside the priority reserve: they must not ask for more (the engine refuses
    such a request, and start-up would fail)."""
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path))
    # a pool of blocks, not of GiB: bfloat16 computes (and caches) in float32 on a CPU
    # without a bfloat16 matmul, where 0.25 GiB held half as many
    engine = LLMEngine(engine_config(dtype="bfloat16", num_kv_blocks=728, max_num_seqs=4,
                                     reserved_priority_seqs=1, reserved_priority_blocks=600))
    assert engine.scheduler.max_len_lower < engine.max_model_len  # the reserve bites
    assert engine.scheduler.step_time_model is not None
    assert not engine.has_unfinished_requests()
    # a reserve of the whole pool leaves the other tiers nothing: refused, by name
    with pytest.raises(ConfigError, match="reserved_priority_blocks 728 leaves no KV block"):
        LLMEngine(engine_config(dtype="bfloat16", num_kv_blocks=728, max_num_seqs=4,
                                reserved_priority_blocks=728))
