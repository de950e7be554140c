"""One stream against the weight-read floor: how close a lone decode step comes to the
time it takes this machine just to read the weights that step reads.

    python benchmarks/decode_floor.py [--quantization gguf] [--rounds 5] [--steps 20]

The floor is measured, not quoted: the bytes a decode step must read (every linear layer's
stored weights and scales, the lm_head included, as the engine holds them) divided by the
read bandwidth of two threads summing a buffer of 512 MB (larger than any cache, so read
from memory as the weights are). The engine is the in-process one, bfloat16 with the
given weights, one sequence of 128 prompt tokens in decode; `--steps` timed `engine.step()`
calls per round (the whole step: scheduling, forward, head, sampling), alternating with a
bandwidth measurement, so a noisy neighbour hits both alike. Prints one line: medians,
the floor and the ratio.
"""

import argparse
import platform
import statistics
import sys
import time

from quant_speed import make_engine, start_decoding, timed_steps


def weight_bytes(model) -> int:
    """Bytes of the tensors a decode step reads: the linear layers' weights and scales
    (packed as held) and the norms; not the embedding table, of which one row is read."""
    import torch

    seen, total = set(), 0
    tensors = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    for name, t in tensors:       # a tied head shares the embedding's tensors: count it
        if name.startswith("embed") or "rope" in name or t.dim() == 0 \
                or t.data_ptr() in seen or not isinstance(t, torch.Tensor):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def read_gbs(buffer) -> float:
    begin = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - begin) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    import torch

    from tierserve.engine.calibrate import cpu_model

    engine = make_engine(args.quantization, args)
    nbytes = weight_bytes(engine.runner.model)
    buffer = torch.ones(512 * 2**20 // 4, dtype=torch.float32)
    start_decoding(engine, 1, 128, seed=0)
    timed_steps(engine, 5)
    steps, bandwidth = [], []
    for _ in range(args.rounds):
        bandwidth += [read_gbs(buffer) for _ in range(3)]
        steps += timed_steps(engine, args.steps)
    step_ms = statistics.median(steps) * 1e3
    gbs = statistics.median(bandwidth)
    floor_ms = nbytes / gbs / 1e6
    print(f"decode_floor cpu='{cpu_model()}' machine={platform.machine()} threads="
          f"{torch.get_num_threads()} quantization={args.quantization} weights_mb="
          f"{nbytes / 1e6:.1f} read_gbs={gbs:.1f} floor_ms={floor_ms:.2f} "
          f"step_ms={step_ms:.2f} ratio={step_ms / floor_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
