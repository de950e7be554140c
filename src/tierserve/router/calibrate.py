"""A replica's step-time model from the outside: `tierserve calibrate --backend URL`.

NOTE: how
    The simulator's fleet twin needs a step-time model for every replica, vLLM's as much as
    tierserve's, and a replica it does not run can only be timed through its API. So this
    sends a grid of streamed `/v1/completions` (prompts of random token ids, so no prefix
    cache helps; `ignore_eos`, greedy) and turns what the stream shows into step records,
    the same (sequences, seconds) pairs the in-process calibration fits:

      lone prefills of rising length   one step of one chunk (n tokens, context n): the
                                       time to the first token
      decode batches of rising size,   one step of b decodes at the context reached: each
      at a short and a long context    gap between two chunks of one stream, taken while
                                       all b streams are decoding (after the last one's
                                       first token; then each hangs up after a few more)

    and fits the model in relative error, as the simulator's whole-step model is fitted,
    but not centred on its records' mean step as that one is (engine/calibrate.py's
    note). Tried in the forty-sixth session for both fits: a step-record fit's records
    took 1.08-1.11x its prediction on average, and in three paired runs of
    benchmarks/fleet_twin.py (two one-core replicas, 0.75 req/s) the centred profiles
    put the twin at 5.0, 10.5 and 21.9% median error against 7.8, 4.3 and 11.5%
    uncentred: in the last two, the timed replays' steps ran 0.80-0.86x the profile
    draw's on average (the machine wandering between the draws: one engine's three
    draws in a row ran 1.11, 0.99 and 1.06x one fit, not slowest at first), and the
    centring carried the draw's slow steps into the profile.
    What the client sees includes the replica's HTTP and detokenizing time, which is what
    a request's TTFT and TPOT include too. Plain Python over httpx: no torch (a gateway
    runs it).

    With `--from-steps` no grid is sent: a tierserve replica (and vLLM with tierserve's
    plugin) keeps its recent steps (GET /tierserve/v1/steps, core/step_log.py), each timed
    from the end of a busy step before it, or from its own start after idle, and the
    model is fitted to those, recorded while the replica served its own traffic (the
    fleet's load, its neighbours busy). Its steps mix prompt chunks with decodes, so the
    chunk term is fitted too; the grid's lone prefills cannot tell it apart.

NOTE: the way in
    A step record holds what the engine did, not what a request went through before its
    first step and after its first token: the replica's HTTP handling, tokenizing, its
    queue to the engine, the stream back. The grid's times hold it (they are the
    client's); a fit to step records does not, so `--from-steps` then sends a few
    one-token requests one after another to the idle replica and keeps the median of
    each one's time to its first token less the step the replica recorded for it: the
    profile's `way_in_s`, which `tierserve sim` adds to every request's way to that
    replica. A gateway's own hop in front is not in it (a probe sent through a gateway
    could not be told which replica's step is its own): `sim --way-in-s` takes a figure
    that holds it.
"""

import asyncio
import json
import random
import statistics
import time

import httpx

from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError

PREFILLS = (16, 64, 256, 512, 1024)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (64, 512)


def grid(max_len: int, max_num_seqs: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Prefill lengths and (batch, context) decode cells within the replica's limits."""
    prefills = [n for n in PREFILLS if n + 8 <= max_len]
    decodes = [(min(b, max_num_seqs), c) for c in DECODE_CONTEXTS if c + 64 <= max_len
               for b in DECODE_BATCHES]
    return prefills, list(dict.fromkeys(decodes))


class _Batch:
    """Streams of one decode cell: when every one has its first token, each reads
    WINDOW more chunks and hangs up (the replica aborts it), so the cell takes as long
    as its prefills and a few steps, however many slots and tokens. Where some do not
    start within SETTLE_S of the last start (a gateway holding lower tiers back for
    priority), the batch is the ones that did."""

    WINDOW = 10
    SETTLE_S = 3.0

    def __init__(self, size: int):
        self.size, self.started, self.all_started = size, 0, asyncio.Event()
        self.since = 0.0
        self._last_start = 0.0

    def first_token(self) -> None:
        self.started += 1
        self._last_start = time.perf_counter()
        if self.started == self.size:
            self._close()

    def _close(self) -> None:
        self.size, self.since = self.started, time.perf_counter()
        self.all_started.set()

    def done(self, times: list[float]) -> bool:
        if not self.all_started.is_set() and self.started \
                and time.perf_counter() - self._last_start > self.SETTLE_S:
            self._close()
        if not self.all_started.is_set():
            return False
        if times[0] > self.since:       # started after the batch closed: not part of it
            return True
        return sum(t > self.since for t in times) >= self.WINDOW


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                  max_tokens: int, batch: _Batch | None = None) -> tuple[float, list[float]]:
    """(send time, arrival time of each chunk that carries text) of one streamed request;
    in a `batch`, until it has seen its window."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    sent, times = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:300]
            raise ConfigError(f"{url}: /v1/completions answered {r.status_code}: {text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
                if batch is not None:
                    if len(times) == 1:
                        batch.first_token()
                    if batch.done(times):
                        break
    return sent, times


async def _measure(url: str, model: str, prefills: list[int], decodes: list[tuple[int, int]],
                   repeats: int, vocab: int, max_len: int, say
                   ) -> list[tuple[list[tuple[int, int]], float]]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    records = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        await _stream(client, url, model, prompt(32), 4)            # warm-up, not kept
        for _ in range(repeats):
            for n in prefills:
                sent, times = await _stream(client, url, model, prompt(n), 2)
                if times:
                    records.append(([(n, n)], times[0] - sent))
            for b, c in decodes:
                batch = _Batch(b)
                runs = await asyncio.gather(*(_stream(client, url, model, prompt(c),
                                                      max_len - c - 1, batch)
                                              for _ in range(b)))
                runs = [r for r in runs if r[1] and r[1][0] <= batch.since]
                start = max(t[0] for _, t in runs)
                end = min(t[-1] for _, t in runs)
                gaps = []
                for _, times in runs:
                    for i in range(1, len(times)):
                        if times[i - 1] >= start and times[i] <= end:
                            gaps.append((i, times[i] - times[i - 1]))
                if len(gaps) < 3:
                    say(f"calibrate: batch {b} at context {c}: streams did not overlap; skipped")
                    continue
                i = int(statistics.median(g[0] for g in gaps))
                records.append(([(1, c + i)] * batch.size,
                                statistics.median(g[1] for g in gaps)))
            say(f"calibrate: {len(records)} step records from {url}")
    return records


MAX_GRID_SEQS = 32
"""Largest decode batch of the grid (a replica that does not say its slot count gets it)."""
VOCAB = 32000
"""Prompt token ids are drawn below this: inside the vocabulary of any model served."""


def discover_info(url: str, model: str | None) -> dict:
    """What the grid needs of the replica: the model to ask for, its context length and
    its slots (remote.discover's sources), or a ConfigError naming what is missing."""
    from tierserve.router.remote import ReplicaSpec, discover

    spec = ReplicaSpec(url.rstrip("/"), models=[model] if model else [])
    spec.validate()
    line = discover(spec)
    if not spec.models:
        raise ConfigError(f"calibrate --backend: {line}")
    if spec.max_model_len is None:
        raise ConfigError(f"calibrate --backend: {spec.url}/v1/models gives no max_model_len "
                          f"for {spec.models[0]!r}")
    slots = min(spec.max_num_seqs or MAX_GRID_SEQS, MAX_GRID_SEQS)
    return {"url": spec.url, "model": spec.models[0], "kind": spec.kind,
            "max_model_len": spec.max_model_len, "max_num_seqs": slots, "vocab": VOCAB}


def calibrate_backend(url: str, model: str | None = None, repeats: int = 2,
                      say=lambda line: None, prefills: list[int] | None = None,
                      decodes: list[tuple[int, int]] | None = None
                      ) -> tuple[StepTimeModel, dict]:
    """Fit a step-time model to `url`'s streamed timings. Returns it and what was learned
    of the replica (model name, max_model_len, slots, step records). `prefills` and
    `decodes` replace the grid's cells (a quick check)."""
    info = discover_info(url, model)
    grid_prefills, grid_decodes = grid(info["max_model_len"], info["max_num_seqs"])
    prefills, decodes = prefills or grid_prefills, decodes or grid_decodes
    say(f"calibrate: {url} serves {info['model']} (max_model_len {info['max_model_len']}, "
        f"{info['max_num_seqs']} slots): prefills {prefills}, decode batches {decodes}")
    records = asyncio.run(_measure(info["url"], info["model"], prefills, decodes,
                                   repeats, info["vocab"], info["max_model_len"], say))
    # No chunk term: the grid's prefills are lone, one record per length, so a chunk's
    # own cost cannot be told from per_token's. Fitted with it (15-30 ms a chunk) the
    # fleet twin's TTFTs came out 5-10x long on a 2-core Zen 4; without it they are short
    # (benchmarks/fleet_twin.py, docs/benchmarks.md): neither is right there yet.
    return _fit(records, info, chunk_term=False)


def _fit(records: list, info: dict, chunk_term: bool) -> tuple[StepTimeModel, dict]:
    """The model fitted in relative error (not centred: see the note), and `info` with the
    records' count and its median error on them."""
    model_fit = StepTimeModel.fit(records, relative=True, chunk_term=chunk_term)
    errors = [abs(model_fit.predict_s(seqs) - s) / s for seqs, s in records]
    info.update(records=len(records), median_error=statistics.median(errors))
    return model_fit, info


MIN_STEP_RECORDS = 50
"""Fewest recorded steps a fit from steps takes."""


def calibrate_from_steps(url: str, model: str | None = None, say=lambda line: None,
                         after: int = 0) -> tuple[StepTimeModel, dict]:
    """Fit a step-time model to the steps `url` recorded while it served `model` (GET
    /tierserve/v1/steps; those with ids above `after`). Returns it and what was learned of
    the replica, as `calibrate_backend` does; a ConfigError where the replica keeps no
    step records, too few, or those of two engines (a dedicated deployment)."""
    info = discover_info(url, model)
    where = f"calibrate --backend {info['url']} --from-steps"
    try:
        r = httpx.get(info["url"] + "/tierserve/v1/steps", params={"after": after},
                      timeout=30.0)
    except httpx.HTTPError as exc:
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if r.status_code == 404:
        raise ConfigError(f"{where}: the replica keeps no step records (GET "
                          "/tierserve/v1/steps answered 404; a tierserve replica and vLLM "
                          "with tierserve's plugin do); time it through its API instead "
                          "(without --from-steps)")
    if r.status_code != 200:
        raise ConfigError(f"{where}: GET /tierserve/v1/steps answered {r.status_code}: "
                          f"{r.text[:200]}")
    steps = [step for step in r.json()["data"] if step["model"] == info["model"]]
    engines = sorted({step["engine"] for step in steps})
    if len(engines) > 1:
        raise ConfigError(f"{where}: the steps come from engines {', '.join(engines)} (a "
                          "dedicated deployment), which one model cannot describe; time it "
                          "through its API instead (without --from-steps)")
    records = [([tuple(q) for q in step["seqs"]], step["seconds"]) for step in steps]
    if len(records) < MIN_STEP_RECORDS:
        raise ConfigError(f"{where}: {len(records)} steps of {info['model']} recorded, "
                          f"fewer than {MIN_STEP_RECORDS}; send the replica traffic "
                          "first (a gateway records none: give a replica's URL)")
    say(f"calibrate: {len(records)} step records from {info['url']}")
    fitted = _fit(records, info, chunk_term=True)
    try:
        info["way_in_s"] = measure_way_in(info, say)
    except ConfigError as exc:   # the fit stands without it
        say(f"calibrate: the way in not measured: {exc}")
        info["way_in_s"] = None
    return fitted


WAY_IN_PROBES = 8
PROBE_TOKENS = 16


def measure_way_in(info: dict, say=lambda line: None,
                   probes: int = WAY_IN_PROBES) -> float | None:
    """What a request to the replica spends outside its steps (see the note on the way
    in), in seconds: `probes` one-token requests one after another, each its time to the
    first token less the step the replica recorded for it; the median. None, and says
    why, where it cannot be told: other steps ran meanwhile (the replica has traffic of
    its own), a probe failed, or a probe's step is not one whole prompt after idle."""
    url, model = info["url"], info["model"]
    before = _steps(url, 2**62)[1]
    rng = random.Random(before)   # other prompts each time: no prefix-cache hit

    async def go() -> list[float | None]:
        out = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            for _ in range(probes):
                prompt = [rng.randrange(100, info["vocab"]) for _ in range(PROBE_TOKENS)]
                out.append(await _first_chunk(client, url, model, prompt))
        return out

    def missed(why: str) -> None:
        say(f"calibrate: the way in not measured: {why}; give `sim --way-in-s` yourself")

    try:
        ttfts = asyncio.run(go())
    except (httpx.HTTPError, ConfigError) as exc:
        missed(f"a probe failed ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    if None in ttfts:
        missed("a probe's stream ended without a token")
        return None
    records = _steps(url, before)[0]   # any model's: another engine's steps share the cores
    if len(records) != probes:
        missed(f"{len(records)} steps ran while {probes} probes were sent one by one (the "
               "replica has other traffic)")
        return None
    probed = [r for r in records if r["model"] == model and r["after_idle"]
              and r["seqs"] == [[PROBE_TOKENS] * 2]]
    if len(probed) != probes:
        missed(f"{probes - len(probed)} of the probes' steps were not one whole "
               f"{PROBE_TOKENS}-token prompt after idle")
        return None
    way_in = statistics.median(t - r["seconds"] for t, r in zip(ttfts, probed))
    say(f"calibrate: the way in {way_in * 1e3:.1f} ms (median of {probes} probes: time to "
        "the first token less the replica's step)")
    return max(way_in, 0.0)


def _steps(url: str, after: int) -> tuple[list[dict], int]:
    """The replica's step records with ids above `after`, and the newest id."""
    try:
        r = httpx.get(url + "/tierserve/v1/steps", params={"after": after}, timeout=30.0)
    except httpx.HTTPError as exc:
        raise ConfigError(f"{url}/tierserve/v1/steps: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise ConfigError(f"{url}/tierserve/v1/steps answered {r.status_code}: "
                          f"{r.text[:200]}")
    body = r.json()
    return body["data"], body["last_id"]


async def _first_chunk(client: httpx.AsyncClient, url: str, model: str,
                       prompt: list[int]) -> float | None:
    """Seconds from sending a one-token streamed request to its first chunk with a
    choice (its token's text may be empty: a byte of a character), None if none came."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True,
            "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:300]
            raise ConfigError(f"{url}: /v1/completions answered {r.status_code}: {text}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and \
                    json.loads(line[6:]).get("choices"):
                return time.perf_counter() - sent
    return None
