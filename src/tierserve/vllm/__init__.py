"""tierserve inside vLLM: the tier scheduler and the exact cost meter as a vLLM plugin.

    vllm serve MODEL --scheduling-policy priority \\
        --scheduler-cls tierserve.vllm.TieredScheduler \\
        --middleware tierserve.vllm.middleware.TierserveMiddleware \\
        [--additional-config '{"tierserve": {"reserved_priority_seqs": 2}}']

`TieredScheduler` (scheduler.py) runs in vLLM's engine-core process: vLLM's own scheduler
with tierserve's tier policy applied to its queues (order, fair shares, aging, the flex
limit, preemption for slots and KV blocks, the step-time cap from a model fitted to this
replica's own steps) and every step's measured time split among its requests by
tierserve's cost meter. `TierserveMiddleware` (middleware.py) runs in the API server: it
serves `/tierserve/v1/info` and `/tierserve/v1/costs` (what each request cost, for a
gateway) and adds the per-tier cost series to vLLM's `/metrics`. Both import only
tierserve's torch-free code (core, metering, tiers) and vLLM: `pip install --no-deps
tierserve` into vLLM's virtualenv is enough.

Supported: vLLM 0.32.x (SUPPORTED below); any other version is refused at start-up with
one line naming both, since the plugin reaches into the scheduler's internals.
"""

SUPPORTED = ((0, 32),)
"""(major, minor) releases of vLLM the plugin was built and tested against."""


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a version the plugin supports."""


def check_version(version: str) -> None:
    """Raise UnsupportedVllmError unless `version` (vllm.__version__) is supported."""
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor not in SUPPORTED:
        wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise UnsupportedVllmError(f"tierserve's vLLM plugin supports vLLM {wanted}; this is "
                                   f"vLLM {version}: install a supported vLLM or run without "
                                   "--scheduler-cls tierserve.vllm.TieredScheduler")


def __getattr__(name: str):
    if name == "TieredScheduler":
        import vllm

        check_version(vllm.__version__)
        from tierserve.vllm.scheduler import TieredScheduler
        return TieredScheduler
    raise AttributeError(name)
