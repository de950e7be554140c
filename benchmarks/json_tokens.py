"""Tokens per valid JSON answer: compact JSON (the default) beside the old free-whitespace
grammar (`[ \\t\\n]{0,20}` at each gap), on a fixed set of schemas and prompts (issue 33).

    python benchmarks/json_tokens.py [--max-tokens 80] [--temperature 0.7] [--seeds 3]

The in-process engine (the default model) answers each (schema, prompt, seed) under both
grammars, in one run, interleaved. An answer is valid when it parses and validates
against its schema within `max_tokens` (one cut before the JSON closes is not). Prints
one JSON line per grammar and one summary line with its config.
"""

import argparse
import json
import platform
import sys

from tierserve.llm import LLM
from tierserve.sampling_params import SamplingParams
from tierserve.structured import GrammarSpec

OLD = r"[ \t\n]{0,20}"
SCHEMAS = {
    "pet": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
        "required": ["name", "kind", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "items": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 10},
                                             "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
        "required": ["id", "items", "paid"], "additionalProperties": False},
    "person": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 16}, "last": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "maxItems": 3}},
        "required": ["first", "last", "address", "tags"], "additionalProperties": False},
    "ticket": {"type": "object", "properties": {
        "priority": {"enum": ["low", "medium", "high"]},
        "summary": {"type": "string", "maxLength": 60},
        "refund": {"type": "boolean"}},
        "required": ["priority", "summary", "refund"], "additionalProperties": False},
}
PROMPTS = {
    "pet": ["Describe a pet as JSON.", "Give me a JSON record of a family dog."],
    "order": ["Write an example shop order as JSON.", "JSON for an order of two books."],
    "person": ["A person's contact card as JSON.", "Make up a customer profile in JSON."],
    "ticket": ["My package arrived broken, I want my money back. Summarize as a JSON ticket.",
               "Turn this into a JSON support ticket: the app crashes at login."],
}


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    llm = LLM(max_num_seqs=16)
    tok = llm.get_tokenizer()
    jobs, params = [], []
    for name, schema in SCHEMAS.items():
        for prompt in PROMPTS[name]:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
            for seed in range(args.seeds):
                for mode, space in (("compact", None), ("free", OLD)):
                    spec = GrammarSpec.json_schema(schema)
                    if space is not None:
                        spec = GrammarSpec(spec.kind, spec.value, spec.param, space)
                    jobs.append((mode, name, ids))
                    params.append(SamplingParams(temperature=args.temperature, seed=seed,
                                                 max_tokens=args.max_tokens, grammar=spec))
    outs = llm.generate([ids for _, _, ids in jobs], params)
    figures = {}
    for (mode, name, _), out in zip(jobs, outs):
        c = out.outputs[0]
        f = figures.setdefault(mode, {"answers": 0, "valid": 0, "tokens": 0,
                                      "valid_tokens": 0, "cut": 0})
        ok = valid(c.text, SCHEMAS[name])
        f["answers"] += 1
        f["tokens"] += len(c.token_ids)
        f["valid"] += ok
        f["valid_tokens"] += len(c.token_ids) if ok else 0
        f["cut"] += c.finish_reason == "length"
    for mode, f in figures.items():
        f["tokens_per_answer"] = round(f["tokens"] / f["answers"], 1)
        f["tokens_per_valid_answer"] = round(f["tokens"] / max(f["valid"], 1), 1)
        f["valid_share"] = round(f["valid"] / f["answers"], 3)
        print(json.dumps({"grammar": mode, **f}))
    c, o = figures["compact"], figures["free"]
    print(f"json_tokens machine={platform.machine()} schemas={len(SCHEMAS)} "
          f"answers={c['answers']}/grammar max_tokens={args.max_tokens} "
          f"temperature={args.temperature}: tokens per valid answer compact "
          f"{c['tokens_per_valid_answer']} vs free-whitespace {o['tokens_per_valid_answer']} "
          f"({c['tokens_per_valid_answer'] / o['tokens_per_valid_answer']:.2f}x); valid "
          f"{c['valid']}/{c['answers']} vs {o['valid']}/{o['answers']}; cut at max_tokens "
          f"{c['cut']} vs {o['cut']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
