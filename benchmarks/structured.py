"""Throughput with a quarter of the requests under a JSON schema, beside none (issue 15).

    python benchmarks/structured.py [--requests 64] [--concurrency 16] [--rounds 2]

The in-process engine (the default model, bf16, `--max-num-seqs` = concurrency) runs the
same prompts twice per round: all unconstrained, then every fourth request under a nested
JSON schema; rounds alternate the order. Output tokens per second over the whole run is
compared (constrained requests stop when their JSON is complete, so token counts differ;
per-token cost is what the mask adds). Prints one line with its config.
"""

import argparse
import json
import statistics
import time

import torch

from tierserve.engine.llm_engine import LLMEngine
from tierserve.llm import engine_config
from tierserve.sampling_params import SamplingParams
from tierserve.structured import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 6},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"},
                                                   "city": {"type": "string"}},
                  "required": ["id", "city"]},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}


def run(engine: LLMEngine, prompts: list[list[int]], structured: bool, max_tokens: int) -> float:
    spec = GrammarSpec.json_schema(SCHEMA)
    for i, p in enumerate(prompts):
        constrained = structured and i % 4 == 0
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                ignore_eos=not constrained,
                                grammar=spec if constrained else None)
        engine.add_request(None, p, params)
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    engine = LLMEngine(engine_config(max_num_seqs=args.concurrency, dtype="bfloat16"))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content":
               f"Describe pet number {i} as JSON with name, kind, age, tags and owner."}])
               for i in range(args.requests)]
    t = time.perf_counter()
    engine._compile(GrammarSpec.json_schema(SCHEMA))  # the vocabulary table, once
    setup_s = time.perf_counter() - t
    run(engine, prompts[:4], True, 8)  # warm-up
    plain, mixed = [], []
    for r in range(args.rounds):
        order = [(False, plain), (True, mixed)]
        for structured, out in (order if r % 2 == 0 else order[::-1]):
            out.append(run(engine, prompts, structured, args.max_tokens))
    ratio = statistics.mean(mixed) / statistics.mean(plain)
    print(f"structured requests={args.requests} concurrency={args.concurrency} "
          f"max_tokens={args.max_tokens} constrained=1/4 schema=nested rounds={args.rounds} "
          f"torch_threads={torch.get_num_threads()} | tok/s none "
          f"{', '.join(f'{x:.1f}' for x in plain)}; 25% JSON schema "
          f"{', '.join(f'{x:.1f}' for x in mixed)} | ratio {ratio:.3f} (target >= 0.90); "
          f"compiler setup {setup_s:.2f} s", flush=True)
    print(json.dumps(engine._grammars.stats.__dict__, default=str))


if __name__ == "__main__":
    main()
