"""Top-p sampling on the real model's probabilities: the nucleus found by sorting the
whole vocabulary (the way it was done before) against the top-k-first search the sampler
uses now, on the same recorded rows, and engine decode steps with each, side by side.

    python benchmarks/sampler.py [--streams 16] [--tokens 24] [--temperature 0.2]
                                 [--top-p 0.9] [--quantization gguf]

Prints one line: the config, ms per sampler call (sort / top-k first), whether every
row kept the same nucleus (as many tokens, as much mass), how often the first k sufficed, and the median decode step of
`--streams` requests with each method.
"""

import argparse
import statistics
import sys
import time

PROMPTS = ["Summarize: the meeting moved to Tuesday because the room was booked.",
           "Write a haiku about a lighthouse.", "What is the capital of France?",
           "List three uses of a paperclip.", "Explain recursion to a child.",
           "Translate 'good morning' into Spanish.", "Give me a name for a grey cat.",
           "Why is the sky blue? Answer in one sentence."]


def sorted_nucleus(probs, top_ps):
    """The reference: sort every row, keep until the mass before a token reaches p."""
    import torch
    p = torch.tensor(top_ps).unsqueeze(1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= p, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def decode_steps(engine, params, streams: int, tokens: int) -> list[float]:
    """Seconds of each step where all `streams` requests decode."""
    for i in range(streams):
        engine.add_request(None, PROMPTS[i % len(PROMPTS)], params)
    times = []
    while engine.has_unfinished_requests():
        decoding = sum(1 for r in engine.scheduler.running
                       if r.num_computed_tokens >= r.num_prompt_tokens)
        begin = time.perf_counter()
        engine.step()
        if decoding == streams:
            times.append(time.perf_counter() - begin)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--quantization", default="gguf", help="as `make serve` (none: bf16)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from tierserve.engine.calibrate import cpu_model
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.llm import engine_config
    from tierserve.sampling_params import SamplingParams
    from tierserve.worker import sampler

    engine = LLMEngine(engine_config(
        quantization=None if args.quantization == "none" else args.quantization,
        max_num_seqs=max(args.streams, 1)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.tokens, ignore_eos=True, seed=0)
    topk_first = sampler._apply_top_p
    recorded, reached = [], []

    def recording(probs, top_ps):
        recorded.append((probs.clone(), list(top_ps)))
        return topk_first(probs, top_ps)

    sampler._apply_top_p = recording
    decode_steps(engine, params, args.streams, args.tokens)  # warm-up, and the rows
    steps = {"sort": [], "topk": []}
    for _ in range(args.rounds):  # alternate, so drift falls on both alike
        for name, fn in (("sort", sorted_nucleus), ("topk", topk_first)):
            sampler._apply_top_p = fn
            steps[name] += decode_steps(engine, params, args.streams, args.tokens)
    sampler._apply_top_p = topk_first

    same, ms = 0, {"sort": [], "topk": []}
    for probs, top_ps in recorded:
        out = {}
        for name, fn in (("sort", sorted_nucleus), ("topk", topk_first)):
            begin = time.perf_counter()
            out[name] = fn(probs, top_ps)
            ms[name].append((time.perf_counter() - begin) * 1e3)
        # the same nucleus: as many tokens, as much mass (of tokens tied in probability
        # at its edge, sort and topk may keep a different one)
        counts = [(out[k] > 0).sum(dim=-1) for k in ("sort", "topk")]
        masses = [(probs * (out[k] > 0)).sum(dim=-1) for k in ("sort", "topk")]
        same += bool((counts[0] == counts[1]).all()
                     and ((masses[0] - masses[1]).abs() <= 1e-6).all())
        kept = int((out["topk"] > 0).sum(dim=-1).max())
        reached.append(kept <= sampler.TOP_P_FIRST_K)
    med = {k: statistics.median(v) for k, v in ms.items()}
    step = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
    print(f"sampler cpu={cpu_model()!r} quantization={args.quantization} streams="
          f"{args.streams} temperature={args.temperature:g} top_p={args.top_p:g} "
          f"calls={len(recorded)}: top_p ms per call sort {med['sort']:.2f} top-k first "
          f"{med['topk']:.2f} ({med['sort'] / med['topk']:.1f}x); the same nucleus "
          f"{same}/{len(recorded)}; within the first {sampler.TOP_P_FIRST_K} "
          f"{sum(reached)}/{len(reached)} | decode step median with sort {step['sort']:.1f} "
          f"ms, top-k first {step['topk']:.1f} ms ({step['sort'] / step['topk']:.2f}x)",
          flush=True)
    return 0 if same == len(recorded) else 1


if __name__ == "__main__":
    sys.exit(main())
