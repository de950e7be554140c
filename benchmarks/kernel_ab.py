"""The CPU kernels of two versions side by side in one process: the lean step's forward
pass and head as git REV holds them (A) against the working tree's (B).

    python benchmarks/kernel_ab.py [--rev HEAD] [--streams 1] [--context 128]
                                   [--quantization gguf] [--rounds 20] [--calls 40]
                                   [--part step|int4|attention|head]

Both extensions are compiled from source (cached under ~/.cache/torch_extensions by the
source's hash) and run over the same model weights and KV caches, on the inputs of one
engine step with `--streams` sequences in decode at about `--context` tokens. Rounds
alternate A and B (and which goes first), `--calls` timed calls each, so a noisy neighbour
hits both alike: on the shared 2-vCPU machines the same step moves 20% from one minute to
the next, more than most kernel changes. Prints whether the outputs are equal and one line
with the medians and B/A. `--part int4` times only the model's 4-bit layers (int4_matmul
over its 120 weights; torch's int4 kernel for a version with none for this CPU) at
`--streams` rows of random input, A and B alike, each with the (s, z) pairs in the order
its lean step keeps them (block order on AVX2 since the forty-second session): two builds
of the same source here differed by up to 10% on the whole step (code placement), so a
change to one kernel is best judged on that kernel too. `--part attention` times only the paged
decode attention of every layer at `--streams` sequences of `--context` tokens, the blocks
of each sequence scattered over the cache as after hours of traffic, and between layers a
read of as many other bytes as a layer's weights, a different slice for each layer (what
a step streams between two attentions, so the caches are read cold, as in a step).
The lean step's AMX copies (model/cpu_step.py, DENSE_ROWS) are off here, so that both
versions run their own kernels at any width (and an older version, which has no copies,
can be built at all). `--part head` times only the lm_head (the lean step's logits) at
`--streams` rows of random input, as the step's head runs for each version.
"""

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from quant_speed import make_engine, start_decoding

ROOT = Path(__file__).resolve().parent.parent


def source_at(rev: str) -> str:
    """The extension's C++ source as the model modules hold it at git revision `rev`."""
    from tierserve.model.kernels import PARTS

    text = ""
    for part in PARTS:
        module = types.ModuleType(part)
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/tierserve/model/"
                                f"{part}.py"], capture_output=True, text=True)
        if shown.returncode:  # a part written after `rev`
            continue
        code = shown.stdout
        exec(compile(code, part, "exec"), module.__dict__)
        text += module.SOURCE
    return text


def build(source: str):
    """Compile `source` as an extension of its own (pybind's class kept module-local, so two
    versions load in one process)."""
    from torch.utils.cpp_extension import load_inline

    from tierserve.model import kernels

    source = source.replace('py::class_<LeanModel>(m, "LeanModel")',
                            'py::class_<LeanModel>(m, "LeanModel", py::module_local())')
    name = "tierserve_ab_" + hashlib.sha1(source.encode()).hexdigest()[:12]
    return load_inline(name=name, cpp_sources=[source], extra_cflags=kernels._FLAGS,
                       extra_ldflags=["-fopenmp"])


def step_inputs(engine):
    """The lean forward's arguments and the head's input of the engine's next step."""
    runner, seen = engine.runner, {}
    lean = runner.lean

    class Record:
        def __call__(self, h, positions, attn):
            seen["forward"] = (h.clone(), positions, attn)
            return lean(h, positions, attn)

        def logits(self, x):
            seen["head"] = x.clone()
            return lean.logits(x)

    runner.lean = Record()
    try:
        engine.step()
    finally:
        runner.lean = lean
    return seen["forward"], seen["head"]


def int4_layers(versions: dict, engine, args, cpu: str) -> int:
    """A against B on the model's 4-bit layers alone, `--streams` rows of random x."""
    import torch

    layers = [lin for layer in engine.runner.model.layers
              for lin in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                          layer.mlp.down_proj) if getattr(lin, "bits", None) == 4]
    def has_kernel(m) -> bool:      # int4_kernel since AVX2 has one; int4_vnni before
        return bool(getattr(m, "int4_kernel", getattr(m, "int4_vnni", False)))

    if not layers or not has_kernel(versions["B"]):
        print("kernel_ab: --part int4 needs 4-bit layers (gguf) and a 4-bit kernel "
              "(AVX-512 VNNI or AVX2)", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(args.streams, lin.group_size * lin.scales.size(0), generator=gen,
                      dtype=torch.bfloat16) for lin in layers]

    def run(m):   # a version without a kernel for this CPU: torch's, as its lean step ran
        if not has_kernel(m):
            return [torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.weight, lin.group_size,
                                                               lin.scales)
                    for x, lin in zip(xs, layers)]
        return [m.int4_matmul(x, lin.weight, scales[m][i], lin.group_size)
                for i, (x, lin) in enumerate(zip(xs, layers))]

    def own_scales(m) -> list:   # each version's scales as its lean step hands them over
        blocked = (getattr(m, "int4_blocked_scales", None)
                   if not getattr(m, "int4_vnni", False) else None)
        return [blocked(lin.scales) if blocked and lin.scales.size(1) % 64 == 0
                else lin.scales for lin in layers]

    scales = {m: own_scales(m) for m in versions.values() if has_kernel(m)}

    same = all(a.equal(b) for a, b in zip(run(versions["A"]), run(versions["B"])))
    times = {"A": [], "B": []}
    for r in range(args.rounds):
        for k in ("AB" if r % 2 else "BA"):
            for _ in range(args.calls):
                begin = time.perf_counter()
                run(versions[k])
                times[k].append(time.perf_counter() - begin)
    a, b = (statistics.median(times[k]) * 1e3 for k in "AB")
    print(f"kernel_ab cpu='{cpu}' quantization={args.quantization} part=int4 layers="
          f"{len(layers)} rows={args.streams} rev={args.rev} outputs_equal={same} "
          f"A_kernel={'ours' if has_kernel(versions['A']) else 'torch'} | "
          f"ms A {a:.3f} B {b:.3f} B/A {b / a:.3f}")
    return 0


def attention(versions: dict, engine, args, cpu: str) -> int:
    """A against B on the paged decode attention alone (see the module's docstring)."""
    import torch
    from decode_floor import weight_bytes

    shape, bs = engine.shape, args.block_size
    hkv, heads, dim = shape.num_kv_heads, shape.num_heads, shape.head_dim
    width = -(-args.context // bs)
    blocks = args.streams * width + 8
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(blocks, bs, hkv, dim, generator=gen).to(torch.bfloat16)
              for _ in range(2 * shape.num_layers)]
    per_layer = max(weight_bytes(engine.runner.model) // shape.num_layers // 4, 1)
    between = torch.ones(shape.num_layers, per_layer)  # a layer's slice each: all of it
    # is read once per step, as the weights are, so no cache keeps the KV caches warm
    tables = torch.randperm(blocks, generator=gen)[:args.streams * width].view(
        args.streams, width).contiguous()
    lens = torch.full((args.streams,), args.context, dtype=torch.long)
    q = torch.randn(args.streams, heads, dim, generator=gen).to(torch.bfloat16)

    def run(m) -> tuple[float, list]:
        spent, outs = 0.0, []
        for layer in range(shape.num_layers):
            between[layer].sum()
            begin = time.perf_counter()
            outs.append(m.paged_decode(q, caches[2 * layer], caches[2 * layer + 1], tables,
                                       lens, dim ** -0.5, None, None))  # bf16: no scales
            spent += time.perf_counter() - begin
        return spent, outs

    same = all(a.equal(b) for a, b in zip(run(versions["A"])[1], run(versions["B"])[1]))
    times = {"A": [], "B": []}
    for r in range(args.rounds):
        for k in ("AB" if r % 2 else "BA"):
            times[k] += [run(versions[k])[0] for _ in range(args.calls)]
    a, b = (statistics.median(times[k]) * 1e3 for k in "AB")
    print(f"kernel_ab cpu='{cpu}' part=attention layers={shape.num_layers} streams="
          f"{args.streams} context={args.context} rev={args.rev} outputs_equal={same} | "
          f"ms per step A {a:.3f} B {b:.3f} B/A {b / a:.3f}")
    return 0


def head(versions: dict, engine, args, cpu: str) -> int:
    """A against B on the lm_head alone, `--streams` rows of random x."""
    import torch
    from tierserve.model import cpu_step

    runner = engine.runner
    lean = {k: cpu_step.LeanForward(m, runner.model, runner.kv_caches)
            for k, m in versions.items()}
    width = runner.model.lm_head.in_features
    x = torch.randn(args.streams, width, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    same = lean["A"].logits(x).equal(lean["B"].logits(x))
    times = {"A": [], "B": []}
    for r in range(args.rounds):
        for k in ("AB" if r % 2 else "BA"):
            for _ in range(args.calls):
                begin = time.perf_counter()
                lean[k].logits(x)
                times[k].append(time.perf_counter() - begin)
    a, b = (statistics.median(times[k]) * 1e3 for k in "AB")
    print(f"kernel_ab cpu='{cpu}' quantization={args.quantization} part=head rows="
          f"{args.streams} rev={args.rev} outputs_equal={same} | "
          f"ms A {a:.3f} B {b:.3f} B/A {b / a:.3f}")
    return 0


def at_least_one(parser, args, names) -> None:
    """Exit through `parser` with a one-line error for the first of `names` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")


def have_kernels(script: str) -> bool:
    """Whether the C++ kernels are built here; if not, says so on stderr as `script`."""
    from tierserve.model import kernels

    if kernels.load() is None:
        print(f"{script}: no C++ kernels here (no compiler, or TIERSERVE_NO_KERNELS)",
              file=sys.stderr)
        return False
    return True


def main(argv=None) -> int:
    os.environ["TIERSERVE_NO_DENSE_COPY"] = "1"    # see the docstring
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--part", choices=("step", "int4", "attention", "head"), default="step",
                   help="int4: the 4-bit layers alone at --streams rows of random x (the "
                        "tile kernel from 5 rows; --context is not used); attention: the "
                        "paged decode attention of every layer alone, read cold; head: "
                        "the lm_head alone at --streams rows of random x")
    args = p.parse_args(argv)
    at_least_one(p, args, ("streams", "rounds", "calls"))
    from tierserve.engine.calibrate import cpu_model
    from tierserve.model import cpu_step, kernels

    if not have_kernels("kernel_ab"):
        return 1
    versions = {"A": build(source_at(args.rev)),
                "B": build(kernels.source())}
    engine = make_engine(args.quantization, args)
    if args.part == "int4":
        return int4_layers(versions, engine, args, cpu_model())
    if args.part == "attention":
        return attention(versions, engine, args, cpu_model())
    if args.part == "head":
        return head(versions, engine, args, cpu_model())
    start_decoding(engine, args.streams, args.context, seed=0)
    runner = engine.runner
    lean = {k: cpu_step.LeanForward(m, runner.model, runner.kv_caches)
            for k, m in versions.items()}
    (h, positions, attn), x = step_inputs(engine)
    out = {k: (f(h.clone(), positions, attn), f.logits(x)) for k, f in lean.items()}
    same = all(a.equal(b) for a, b in zip(out["A"], out["B"]))

    def timed(f) -> list[float]:
        times = []
        for _ in range(args.calls):
            hh = h.clone()
            begin = time.perf_counter()
            f(hh, positions, attn)
            f.logits(x)
            times.append(time.perf_counter() - begin)
        return times

    times = {"A": [], "B": []}
    for r in range(args.rounds):
        for k in ("AB" if r % 2 else "BA"):
            times[k] += timed(lean[k])
    a, b = (statistics.median(times[k]) * 1e3 for k in "AB")
    print(f"kernel_ab cpu='{cpu_model()}' quantization={args.quantization} streams="
          f"{args.streams} context={args.context} rev={args.rev} outputs_equal={same} | "
          f"forward+head ms A {a:.3f} B {b:.3f} B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
