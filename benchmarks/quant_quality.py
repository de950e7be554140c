"""Quality of each weight format against the float32 model: mean KL divergence and top-1
agreement of next-token distributions, teacher-forced over the varied text below.

    python benchmarks/quant_quality.py [--model PATH] [--chunk 512] [--threads 2] [--lean]
                                       [--decode] [--concat] [--only REGEX]

One line per format. The reference is the checkpoint in float32 (for the default model,
whose linear weights are Q4_1 and embeddings Q8_0, that is the file's exact values: a
format is judged by what it adds to the file's own error). Each document is one sequence
from position 0, cut into pieces of `--chunk` tokens; quantized layers run their kernels at
every size, as a decode does (the dequantizing path of long prefills is the same weights
with one more bfloat16 rounding). With `--lean` the lean step computes each piece as the
engine computes a prompt chunk of that length: its own 4- and 8-bit kernels, inputs rounded
to int8 per group of 32 for the 4-bit layers (AVX-512 VNNI or AVX2; elsewhere torch's int4
kernel, and where torch packs 64 outputs a block, pieces over 96 tokens dequantize); on a CPU with AMX, pieces over 32 tokens take its bfloat16 copies
(cpu_step.DENSE_ROWS): there `--chunk 32`, or `TIERSERVE_NO_DENSE_COPY=1`, measures what
decode steps of up to 32 sequences compute. Every row of a piece goes through the head, as
no engine step does (it sends only the rows it samples). `--lean` runs each of those twice:
the prompt's attention by torch's SDPA, and by the paged kernel with each position a query
over its own context (", paged prefill": what the engine's lean step computes, except over
an int8 KV cache). With `--decode`, bf16 and gguf also run as the engine decodes, one token
per lean step through the paged decode kernel, with the KV cache in the model's dtype and
in int8 (`--kv-cache-dtype int8`): the two differ only in the cache.

Formats: bf16 (--quantization none), int8, gguf, each with the lm_head quantized (the
default) and kept bfloat16; q4_0 (the weights requantized to Q4_0 blocks by the `gguf`
package, as a Q4_0 file would hold them, then kept as int4); q6_k-sim and q6_k-sim->int8
(a Q6_K-style grid, 16-weight groups of 6-bit codes with 8-bit scales, in bfloat16, then
requantized to int8 per channel as --quantization gguf does with Q6_K blocks).
"""

import argparse
import copy
import platform
import re
import sys
import time

import torch

TEXTS = [
    # prose
    """The lighthouse keeper's log for the winter of that year is mostly about weather. Wind
from the north-east for nine days, then a calm so complete that the fog sat on the water
like wet wool. On the tenth day a fishing boat came in with a broken rudder, steering with
an oar lashed to the stern, and the keeper wrote that the men aboard were too tired to
speak. He gave them soup and let them sleep in the oil store, which was the only warm room
he had. In the morning they mended the rudder with a length of iron from his workshop and
left before the tide turned. He never learned their names, but he kept the oar.""",
    """Most arguments about city planning are really arguments about time. A new tram line
costs money now and saves minutes for thirty years; a parking garage is cheap to approve
and expensive to live beside. Residents who will move in a decade weigh these differently
from those who expect to stay, and neither group is wrong. What helps is to state the
trade plainly: who pays, who benefits, and when. Councils that publish those three things
before a vote tend to have shorter meetings and fewer lawsuits afterwards.""",
    """Bread starts with four things: flour, water, salt and a living culture. Mix the flour
and water first and let them rest for half an hour, so the flour drinks the water and the
gluten begins to form on its own. Then add the salt and the starter, fold the dough every
thirty minutes for two hours, and leave it overnight somewhere cool. In the morning shape
it gently, bake it hot in a covered pot, and wait until it has cooled before you cut it,
however hard that is.""",
    # code
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns a sorted list."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


class LRUCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        if len(self.items) >= self.capacity:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value
''',
    """#include <stdio.h>

int main(void) {
    int counts[26] = {0};
    int c;
    while ((c = getchar()) != EOF) {
        if (c >= 'a' && c <= 'z') counts[c - 'a']++;
        else if (c >= 'A' && c <= 'Z') counts[c - 'A']++;
    }
    for (int i = 0; i < 26; i++)
        if (counts[i]) printf("%c %d\\n", 'a' + i, counts[i]);
    return 0;
}
""",
    # lists and instructions
    """Packing list for three days in the mountains:
1. A warm jacket, even in summer; nights above 2,000 m are cold.
2. Two pairs of wool socks and one spare base layer.
3. Water filter, two one-litre bottles, and purification tablets as a backup.
4. Map, compass and a charged phone with the route saved offline.
5. First-aid kit: blister plasters, bandage, painkillers, tape.
6. Food for four days, not three.
- Leave your route with someone at home.
- Turn back if the weather changes; the mountain will still be there next year.""",
    # numbers and a table
    """Quarterly results (in thousands of euros):
| quarter | revenue | costs | margin |
|---------|---------|-------|--------|
| Q1 2025 | 1,240   | 1,010 | 18.5%  |
| Q2 2025 | 1,385   | 1,092 | 21.2%  |
| Q3 2025 | 1,290   | 1,104 | 14.4%  |
| Q4 2025 | 1,512   | 1,187 | 21.5%  |
Revenue grew 21.9% from Q1 to Q4 while costs grew 17.5%. The third quarter dipped
because two contracts moved into October. Headcount went from 14 to 17. Cash at year end
was 2.31 million, up from 1.87 million. The board approved a budget of 6.2 million for
2026, with 0.4 million held back for hiring.""",
    """Conversions worth remembering: 1 mile is 1.609 km; 1 inch is 2.54 cm; 1 pound is
0.4536 kg; 0 degrees Celsius is 32 degrees Fahrenheit and 100 C is 212 F. The speed of
light is 299,792,458 m/s. Pi is 3.14159265358979; e is 2.71828182845905. A year has
31,536,000 seconds, or 31,622,400 in a leap year. 2 to the power 10 is 1024, to the power
20 is 1,048,576, and to the power 32 is 4,294,967,296.""",
    # dialogue and a different register
    """"Did you lock the back door?" she asked.
"I think so."
"You think so, or you did?"
He went to check. It was unlocked, as it had been every night that week, and as he turned
the key he wondered why a habit so small was so hard to learn. Behind him she laughed,
not unkindly, and put the kettle on.""",
    """Abstract. We study the scheduling of mixed prefill and decode work on a shared
accelerator under a per-step token budget. We show that admitting decode tokens first and
filling the remainder with prefill chunks bounds the inter-token latency of running
requests by the cost of one budget-sized step, and that the throughput loss relative to
unbounded batching is at most the fraction of the budget left idle at the end of each
prompt. Experiments on three model sizes confirm the bound within 4%.""",
    """JSON configuration: {"name": "edge-cache", "replicas": 3, "regions": ["eu-west",
"us-east"], "limits": {"cpu": "500m", "memory": "256Mi"}, "probes": {"path": "/healthz",
"period_s": 10}, "features": {"compression": true, "ttl_s": 3600}}""",
]


def documents(tokenizer, chunk: int, concat: bool = False) -> list[list[int]]:
    """The texts as token lists cut into pieces of at most `chunk`; `concat`: all of them
    one after another as one document first (long contexts)."""
    docs = [tokenizer.encode(t) for t in TEXTS]
    # More numbers and code, generated: a table of squares and a loop-unrolled function.
    squares = "\n".join(f"{i} squared is {i * i}, and {i} cubed is {i ** 3}."
                        for i in range(3, 60))
    lines = "\n".join(f"    total += values[{i}] * weights[{i}]  # term {i}" for i in range(40))
    code = f"def dot(values, weights):\n    total = 0\n{lines}\n    return total\n"
    docs += [tokenizer.encode(squares), tokenizer.encode(code)]
    if concat:
        docs = [[t for d in docs for t in d]]
    pieces = [d[i:i + chunk] for d in docs for i in range(0, len(d), chunk)]
    return [p for p in pieces if len(p) > 1]


def logits(model, tokens: list[int], lean: bool = False, paged: bool = False) -> torch.Tensor:
    """Teacher-forced float32 logits [T, vocab] of one sequence from position 0; `lean`:
    through the lean step (model/cpu_step.py) instead of the Python layers; `paged`: its
    attention by the paged kernel, each position a query over its own context, as the
    engine computes a prefill chunk in the lean step (torch's SDPA otherwise)."""
    from tierserve.model import cpu_step, kernels
    from tierserve.model.llama import AttentionMetadata

    T = len(tokens)
    shape = model.shape
    dtype = next(model.parameters()).dtype
    caches = cpu_step.new_kv_caches(shape, -(-T // 16), 16, dtype)
    attn = AttentionMetadata.one_sequence(T, kernels.load() if paged else None)
    with torch.inference_mode():
        if lean:
            forward = cpu_step.LeanForward(kernels.load(), model, caches)
            hidden = forward(model.embed(torch.tensor(tokens)), torch.arange(T), attn)
            return forward.logits(hidden)
        else:
            hidden = model(torch.tensor(tokens), torch.arange(T), attn, caches)
        return model.compute_logits(hidden)


def q6k_sim(w: torch.Tensor) -> torch.Tensor:
    """Values on a Q6_K-style grid: per 16 weights a scale, itself an int8 multiple of a
    float16 step per 64 weights (Q6_K's is per 256, which does not divide SmolLM2's 576);
    codes -32..31."""
    n, k = w.shape
    g = w.float().view(n, k // 64, 4, 16)
    sub = g.abs().amax(-1) / 31                                           # [n, S, 16]
    d = (sub.amax(-1, keepdim=True) / 127).half().float().clamp(min=1e-12)
    scale = torch.round(sub / d).clamp(1, 127) * d
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-32, 31)
    return (q * scale.unsqueeze(-1)).view(n, k)


LEAN = ", lean step"
PAGED = ", lean step, paged prefill"
DECODED = ", decoded, kv_cache_dtype="
GGUF = "gguf (Q4_1->int4, Q8_0 head->int8)"


def build_formats(ref, path: str):
    """name -> model, all derived from the float32 reference (one GGUF load)."""
    from gguf import GGMLQuantizationType, quants

    from tierserve.model.cpu_linear import pack_linears
    from tierserve.model.gguf_quant import decode_q4_0
    from tierserve.model.gguf_quant import quantize_model
    from tierserve.model.quant import QuantLinear, int8_linear

    base = copy.deepcopy(ref).to(torch.bfloat16)   # the tie survives: one parameter

    def derive(method=None, lm_head=True, convert=None):
        m = copy.deepcopy(base)
        if method:
            quantize_model(m, method, path, lm_head=lm_head)
        for name, child in list(m.layers.named_modules()):
            if convert and isinstance(child, torch.nn.Linear):
                parent, _, attr = name.rpartition(".")
                w32 = ref.layers.get_submodule(name).weight   # from float32, not bf16
                setattr(m.layers.get_submodule(parent), attr, convert(child, w32))
        pack_linears(m)                   # what ModelRunner does to the float layers left
        for mod in m.modules():
            if isinstance(mod, QuantLinear):
                mod.dequant_rows = None   # the kernels at every size, as a decode runs
        return m

    def q4_0(lin, w32):
        raw = quants.quantize(w32.numpy(), GGMLQuantizationType.Q4_0)
        g = decode_q4_0(torch.from_numpy(raw))
        return QuantLinear.int4(g.codes, g.scale, g.minimum, lin.bias, torch.bfloat16)

    def q6k_dense(lin, w32):
        lin.weight.copy_(q6k_sim(w32))
        return lin

    def q6k_int8(lin, w32):
        return int8_linear(q6k_sim(w32), lin.bias, torch.bfloat16)

    return {
        "bf16 (none)": derive(),
        "int8": derive("int8"),
        "int8, lm_head bf16": derive("int8", lm_head=False),
        GGUF: derive("gguf"),
        "gguf, lm_head bf16": derive("gguf", lm_head=False),
        "q4_0 requantized->int4, lm_head bf16": derive(convert=q4_0),
        "q6_k-sim dense bf16, lm_head bf16": derive(convert=q6k_dense),
        "q6_k-sim->int8, lm_head bf16": derive(convert=q6k_int8),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    p.add_argument("--chunk", type=int, default=512, help="most tokens per sequence")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lean", action="store_true",
                   help="also bf16 and gguf through the lean step (one C++ forward pass), its "
                        "prefill attention by torch's SDPA and by the paged kernel")
    p.add_argument("--decode", action="store_true",
                   help="also bf16 and gguf decoded one token per step through the lean "
                        "step, with the KV cache in the model's dtype and in int8 "
                        "(--kv-cache-dtype)")
    p.add_argument("--concat", action="store_true",
                   help="the texts as one document (with --chunk 4096: one sequence of "
                        "about 3,800 tokens, for the KV cache formats at long context)")
    p.add_argument("--only", default=None,
                   help="a regular expression: run the formats whose names match (default: all)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tierserve.config import ModelConfig
    from tierserve.model import cpu_step, kernels
    from tierserve.model.loader import load_model
    from tierserve.model.tokenizer import Tokenizer

    start = time.perf_counter()
    loaded = load_model(ModelConfig(model=args.model, dtype="float32"), args.chunk)
    ref = loaded.model
    docs = documents(Tokenizer.load(loaded.tokenizer_source), args.chunk, args.concat)
    formats = build_formats(ref, loaded.source)
    if args.lean:
        if kernels.load() is None:
            print("quant_quality: --lean needs the CPU kernels", file=sys.stderr)
            return 1
        formats |= {name + suffix: formats[name] for name in ("bf16 (none)", GGUF)
                    for suffix in (LEAN, PAGED)}
    if args.decode:
        if kernels.load() is None:
            print("quant_quality: --decode needs the CPU kernels", file=sys.stderr)
            return 1
        formats |= {f"{name}{DECODED}{kv}": formats[name] for name in ("bf16 (none)", GGUF)
                    for kv in ("auto", "int8")}
    if args.only:
        formats = {n: m for n, m in formats.items() if re.search(args.only, n)}
        if not formats:
            print(f"quant_quality: no format name matches {args.only!r}", file=sys.stderr)
            return 2
    kl = {name: 0.0 for name in formats}
    top1 = {name: 0 for name in formats}
    count = 0
    for tokens in docs:
        ref_lp = torch.log_softmax(logits(ref, tokens), -1)
        for name, model in formats.items():
            if DECODED in name:
                out = cpu_step.decode_logits(kernels.load(), model, tokens,
                                             name.rpartition(DECODED)[2])
            else:
                out = logits(model, tokens, name.endswith((LEAN, PAGED)), name.endswith(PAGED))
            lp = torch.log_softmax(out, -1)
            kl[name] += (ref_lp.exp() * (ref_lp - lp)).sum(-1).sum().item()
            top1[name] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum().item()
        count += len(tokens)
    print(f"# model={loaded.source} reference=float32 tokens={count} docs={len(docs)} "
          f"chunk={args.chunk} threads={args.threads} torch={torch.__version__} "
          f"cpu={platform.machine()} wall_s={time.perf_counter() - start:.0f}")
    for name in formats:
        print(f"format={name:<48} mean_kl={kl[name] / count:.5f} "
              f"top1_agreement={top1[name] / count:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
