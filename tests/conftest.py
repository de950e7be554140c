"""Shared test helpers: scheduler builders (no torch) and real-model engines (CPU)."""

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

from tierserve.config import SchedulerConfig
from tierserve.core.block_manager import BlockManager
from tierserve.core.request import Request
from tierserve.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from tierserve.tiers import Tier

# Step-time calibrations are cached per machine and configuration (engine/calibrate.py):
# the suite keeps its own, so it neither reads nor fills the user's cache.
os.environ["TIERSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="tierserve-test-cache-")


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   chunked=True, prefix_caching=True, max_model_len=1024, policy="fcfs",
                   step_time_model=None, step_time_limit_s=None, speculative=None,
                   **tier_options) -> Scheduler:
    """`tier_options`: more SchedulerConfig fields (reserves, aging, flex wait limit);
    `speculative`: a SpeculativeConfig (drafts by prompt lookup)."""
    bm = BlockManager(num_blocks, block_size, prefix_caching, evict_by_tier=policy == "tiered")
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=chunked, policy=policy, **tier_options)
    cfg.validate()
    return Scheduler(cfg, bm, max_model_len, step_time_model=step_time_model,
                     step_time_limit_s=step_time_limit_s, speculative=speculative)


def make_requests(n, prompt_len=10, max_tokens=5, start=0, arrival_step=1.0, prompts=None,
                  tier=Tier.DEFAULT, arrival_time=None):
    out = []
    for i in range(n):
        prompt = prompts[i] if prompts else [100 + 7 * (start + i) + j for j in range(prompt_len)]
        out.append(Request(request_id=f"r{start + i}", prompt_token_ids=list(prompt),
                           max_tokens=max_tokens, tier=tier,
                           arrival_time=(start + i) * arrival_step if arrival_time is None
                           else arrival_time))
    return out


class FakeRunner:
    """Samples a deterministic token per request: (request number * 31 + position) % 997."""

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        for s in output.seqs:
            if s.sample:
                sampled[s.request_id] = 3 + (s.start_pos + len(s.token_ids)) % 997
        return RunnerOutput(sampled)


def run_to_completion(scheduler: Scheduler, runner=None, max_steps=10_000, check=True):
    runner = runner or FakeRunner()
    steps = []
    while scheduler.has_unfinished():
        out = scheduler.schedule(now=float(len(steps)))
        steps.append(out)
        scheduler.update(out, runner.execute(out))
        if check:
            check_scheduler_invariants(scheduler, out)
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def check_scheduler_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    bm = scheduler.block_manager
    bm.check_invariants()
    assert out.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(out.seqs) <= scheduler.config.max_num_seqs
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    held = sum(len(r.block_table) for r in scheduler.requests.values())
    assert held == sum(b.ref_count for b in bm.blocks)
    waiting = [r for r in scheduler.requests.values() if r not in scheduler.running]
    assert scheduler.num_waiting == len(waiting)
    assert scheduler._waiting_default == sum(r.tier == Tier.DEFAULT for r in waiting)


# ------------------------------------------------------------- real model
@pytest.fixture(scope="session")
def default_model_path():
    from tierserve.model.loader import default_model_path
    return default_model_path()


_ENGINES: dict = {}


MAX_CACHED_ENGINES = 2
"""A float32 engine holds about 2.7 GB (its KV pool most of it): caching every
configuration for the whole session outgrew the machine's 24 GiB once the suite had a
dozen of them, and three did once more when the suite grew again. Tests of one file
mostly share a configuration, so the last two suffice."""


def _release_memory() -> None:
    """Collect the evicted engine and hand freed heap pages back to the system (glibc
    keeps them otherwise, and the suite's peak is what the machine must hold)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def get_engine(**kwargs):
    """A float32 engine on the default model, cached per configuration (the most recently
    used few, see MAX_CACHED_ENGINES)."""
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("priority_step_time_s", 0)  # no cap, no calibration unless asked
    key = repr(sorted(kwargs.items()))  # repr: values may be dicts (slo)
    if key in _ENGINES:
        _ENGINES[key] = _ENGINES.pop(key)  # most recently used last
        return _ENGINES[key]
    while len(_ENGINES) >= MAX_CACHED_ENGINES:
        _ENGINES.pop(next(iter(_ENGINES)))
        _release_memory()
    _ENGINES[key] = LLMEngine(engine_config(**kwargs))
    return _ENGINES[key]


def generate(engine, prompts, params):
    """Run prompts to completion on `engine`; outputs in input order."""
    ids = [engine.add_request(None, p, params if not isinstance(params, list) else params[i])
           for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (they are not a package), for tests of its parts."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to `n` inside the block, restored after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
