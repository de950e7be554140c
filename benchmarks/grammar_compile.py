"""Grammar compile time, first and cached, for a nested JSON schema; prints one line.

    python benchmarks/grammar_compile.py [--tokens 64] [--seed 0]

llguidance builds its lexer lazily, so part of a schema's cost moves from compile to the
first masks; the line also gives the mean mask time over a walk of --tokens tokens
(uniform among allowed tokens, one request, one torch thread) and the one-time setup of
the tokenizer's token trie. "cached" includes building the spec from the schema dict, as
a request would. Tokenizer: the default model's (SmolLM2-135M-Instruct).
"""

import argparse
import platform
import time

import torch

from tierserve.model.metadata import default_model_path
from tierserve.model.tokenizer import Tokenizer
from tierserve.structured import GrammarSpec
from tierserve.worker.grammar import GrammarCompiler, GrammarState

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
            "address": {"type": "object", "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"},
                                                         "lon": {"type": "number"}},
                        "required": ["lat", "lon"]}},
                "required": ["city", "zip", "geo"]}},
            "required": ["name", "email", "roles", "address"]},
        "items": {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "kind": {"anyOf": [{"const": "physical"}, {"const": "digital"}]}},
            "required": ["sku", "qty", "kind"], "additionalProperties": False}},
    },
    "required": ["id", "user", "items"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens in the mask walk")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.load(default_model_path())

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer)
    setup_s = time.perf_counter() - start
    spec = GrammarSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    grammar = compiler.compile(spec)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(GrammarSpec.json_schema(SCHEMA))
    cached_s = time.perf_counter() - start

    state, gen, mask_s, n = GrammarState(grammar), torch.Generator().manual_seed(args.seed), 0.0, 0
    while n < args.tokens and not state.is_done():
        start = time.perf_counter()
        allowed = state.allowed_mask(grammar.vocab_size)
        mask_s += time.perf_counter() - start
        choices = allowed.nonzero().flatten()
        state.accept(int(choices[torch.randint(len(choices), (1,), generator=gen)]))
        n += 1
    print(f"grammar_compile schema=nested(3 levels) tokens={n} seed={args.seed} "
          f"cpu={platform.processor() or platform.machine()} "
          f"trie_setup={setup_s * 1e3:.0f}ms first={first_s * 1e3:.2f}ms "
          f"cached={cached_s * 1e6:.1f}us mask_mean={mask_s / max(n, 1) * 1e3:.3f}ms")


if __name__ == "__main__":
    main()
