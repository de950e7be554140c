"""Where a decode step's time goes, part by part, beside the weight-read floor.

    python benchmarks/step_parts.py [--quantization gguf] [--streams 1] [--context 128]
                                    [--rounds 6] [--calls 30] [--kv-cache-memory-gb 0.5]
                                    [--block-size 16]

decode_floor.py says how far a lone decode step is from the time this machine takes just
to read its weights; this says where the rest goes. The lean step's C++ source
(model/cpu_step.py) is built a second time with a clock read around each part of a layer
(the four linears, RoPE with the cache store, attention; what is left of the forward is
the norms, the activation, the allocations between them, and the call's own gathering of
RoPE's cos and sin and a copy of its input) and run on the inputs of one
engine step with `--streams` sequences in decode at about `--context` tokens. The head is
timed as its own call. What the engine's `step()` spends outside the forward and the head
(scheduling, inputs, sampling, detokenizing) is its time less theirs within it, on the
regular build, over sequences started afresh each round at `--context` tokens (their
contexts grow by `--calls`). Rounds take turns with a
read of 512 MB (the bandwidth, as decode_floor.py measures it), so a noisy neighbour hits
all of them alike. Prints one line: each part's ms a step (medians over rounds), for the
weights the rate each kind was read at, and what the whole step spends outside the
forward and the head.
"""

import argparse
import os
import platform
import statistics
import sys
import time

from decode_floor import read_gbs, weight_bytes
from kernel_ab import at_least_one, build, have_kernels, step_inputs
from quant_speed import make_engine, start_decoding

PARTS = ("qkv", "rope", "attention", "o", "gate_up", "down")
ANCHORS = (   # (what the lean forward says, what the instrumented build says instead)
    ("at::Tensor qkv = lin[0](x).contiguous();",
     "double ts_a = ts_now(); at::Tensor qkv = lin[0](x).contiguous(); "
     "TS_PARTS[0] += ts_now() - ts_a; ts_a = ts_now();"),
    ("at::Tensor attn = attention(q, qkv,",
     "TS_PARTS[1] += ts_now() - ts_a; ts_a = ts_now(); at::Tensor attn = attention(q, qkv,"),
    ("at::Tensor o = lin[1](attn.view({T, q_size})).contiguous();",
     "TS_PARTS[2] += ts_now() - ts_a; ts_a = ts_now(); "
     "at::Tensor o = lin[1](attn.view({T, q_size})).contiguous(); "
     "TS_PARTS[3] += ts_now() - ts_a;"),
    ("at::Tensor gu = lin[2](x).contiguous();",
     "ts_a = ts_now(); at::Tensor gu = lin[2](x).contiguous(); "
     "TS_PARTS[4] += ts_now() - ts_a;"),
    ("m = lin[3](act).contiguous();",
     "ts_a = ts_now(); m = lin[3](act).contiguous(); TS_PARTS[5] += ts_now() - ts_a;"),
    ("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {",
     "static std::vector<double> ts_parts() {\n"
     f"  std::vector<double> v(TS_PARTS, TS_PARTS + {len(PARTS)});\n"
     "  for (double& t : TS_PARTS) t = 0;\n  return v;\n}\n"
     "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n  m.def(\"ts_parts\", &ts_parts);"),
)
CLOCK = (f"#include <chrono>\nstatic double TS_PARTS[{len(PARTS)}];\n"
         "static inline double ts_now() {\n  return std::chrono::duration<double>(\n"
         "      std::chrono::steady_clock::now().time_since_epoch()).count();\n}\n")


def instrumented(source: str) -> str:
    """The extension's source with the clock reads (ANCHORS); a SystemExit naming the
    first anchor the lean forward no longer holds exactly once."""
    for old, new in ANCHORS:
        if source.count(old) != 1:
            sys.exit(f"step_parts: model/cpu_step.py no longer holds `{old}` once; "
                     "update ANCHORS")
        source = source.replace(old, new)
    return CLOCK + source


class Timing:
    """The engine's lean forward and head, each call's seconds appended to `spent`."""

    def __init__(self, lean, spent: list):
        self.lean, self.spent = lean, spent

    def __call__(self, *args):
        begin = time.perf_counter()
        out = self.lean(*args)
        self.spent.append(time.perf_counter() - begin)
        return out

    def logits(self, x):
        begin = time.perf_counter()
        out = self.lean.logits(x)
        self.spent.append(time.perf_counter() - begin)
        return out


def linear_bytes(linear) -> int:
    return sum(t.numel() * t.element_size() for t in linear.state_dict().values())


def measure(engine, timed, forward, inputs: tuple, x, args) -> tuple[dict, list]:
    """Per round: the read bandwidth (three reads), the instrumented forward and its parts,
    the head, then the engine's own steps less their forward and head (`outside`)."""
    import torch

    buffer = torch.ones(512 * 2**20 // 4, dtype=torch.float32)
    h, positions, attn = inputs
    per = {k: [] for k in (*PARTS, "forward", "head", "outside")}
    inner: list[float] = []   # the engine's own forward and head in its step, timed
    engine.runner.lean = Timing(engine.runner.lean, inner)
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth += [read_gbs(buffer) for _ in range(3)]
        timed.ts_parts()
        begin = time.perf_counter()
        for _ in range(args.calls):
            forward(h.clone(), positions, attn)
        per["forward"].append((time.perf_counter() - begin) / args.calls)
        for k, spent in zip(PARTS, timed.ts_parts()):
            per[k].append(spent / args.calls)
        begin = time.perf_counter()
        for _ in range(args.calls):
            forward.logits(x)
        per["head"].append((time.perf_counter() - begin) / args.calls)
        ids = start_decoding(engine, args.streams, args.context, seed=0)
        for _ in range(args.calls):   # contexts from --context on
            inner.clear()
            begin = time.perf_counter()
            engine.step()
            per["outside"].append(time.perf_counter() - begin - sum(inner))
        for request_id in ids:
            engine.abort_request(request_id)
    return per, bandwidth


def main(argv=None) -> int:
    os.environ["TIERSERVE_NO_DENSE_COPY"] = "1"     # the integer kernels at any width
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    at_least_one(p, args, ("streams", "context", "rounds", "calls"))
    import torch

    from tierserve.engine.calibrate import cpu_model
    from tierserve.model import cpu_step, kernels

    if not have_kernels("step_parts"):
        return 1
    timed = build(instrumented(kernels.source()))
    engine = make_engine(args.quantization, args)
    model = engine.runner.model
    ids = start_decoding(engine, args.streams, args.context, seed=0)
    forward = cpu_step.LeanForward(timed, model, engine.runner.kv_caches)
    (h, positions, attn), x = step_inputs(engine)
    for request_id in ids:
        engine.abort_request(request_id)
    kinds = {"qkv": "attn.qkv_proj", "o": "attn.o_proj", "gate_up": "mlp.gate_up_proj",
             "down": "mlp.down_proj"}
    nbytes = {k: sum(linear_bytes(model.get_submodule(f"layers.{i}.{path}"))
                     for i in range(len(model.layers))) for k, path in kinds.items()}
    nbytes["head"] = linear_bytes(model.lm_head)
    per, bandwidth = measure(engine, timed, forward, (h, positions, attn), x, args)
    ms = {k: statistics.median(v) * 1e3 for k, v in per.items()}
    gbs = statistics.median(bandwidth)
    rest = ms["forward"] - sum(ms[k] for k in PARTS)
    whole = ms["forward"] + ms["head"] + ms["outside"]
    weights = weight_bytes(model)

    def rate(k: str) -> str:
        return f"{ms[k]:.2f} ({nbytes[k] / ms[k] / 1e6:.1f} GB/s)"

    print(f"step_parts cpu='{cpu_model()}' machine={platform.machine()} threads="
          f"{torch.get_num_threads()} quantization={args.quantization} streams="
          f"{args.streams} context={args.context} rounds={args.rounds} calls={args.calls} "
          f"block_size={args.block_size} read_gbs={gbs:.1f} floor_ms="
          f"{weights / gbs / 1e6:.2f} | ms a step: forward "
          f"{ms['forward']:.2f} [qkv {rate('qkv')}, o {rate('o')}, gate_up "
          f"{rate('gate_up')}, down {rate('down')}, rope {ms['rope']:.2f}, attention "
          f"{ms['attention']:.2f}, rest {rest:.2f}] + head {rate('head')} + outside "
          f"them {ms['outside']:.2f} = {whole:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
