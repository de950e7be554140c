"""This CPU's peak rate of 8-bit dot products (vpdpbusd on 512-bit registers, AVX-512 VNNI),
the instruction the 4-bit and 8-bit kernels spend their arithmetic in: the ceiling any
"fraction of peak" figure for them is taken against.

    python benchmarks/dot_peak.py [--threads N] [--seconds 0.5]

Each thread (default: torch's thread count) runs 12 independent chains of vpdpbusd on
registers (each chain's inputs its own and hidden from the compiler, the loop unrolled, so
nothing is folded or kept in memory) for about --seconds, all threads at once; prints one
line with the CPU and the multiply-adds a second: in all (every thread's count over the
wall time of the whole call) and per thread. A first version of this measurement
(twenty-eighth session, written ad hoc with `gcc -O2`) kept its accumulators in memory,
ran at half this rate, and was taken for the peak; docs/benchmarks.md says what that
changed.
"""

import argparse
import platform
import sys
import time

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <chrono>
#include <vector>
#if defined(__AVX512VNNI__)
#include <immintrin.h>
// Per thread: 8-bit multiply-adds done and the seconds they took, `threads` threads at once.
std::vector<double> dot_peak(int64_t threads, double seconds) {
  std::vector<double> out(2 * threads, 0.0);   // per thread: (multiply-adds, seconds)
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      __m512i a = _mm512_set1_epi8(3 + t), b[12], acc[12];
      for (int i = 0; i < 12; ++i) b[i] = _mm512_set1_epi8(5 + i), acc[i] = _mm512_set1_epi32(i);
      int64_t rounds = 0;
      const auto begin = std::chrono::steady_clock::now();
      double spent = 0.0;
      while (spent < seconds) {
        for (int it = 0; it < 100000; ++it) {
          __asm__ volatile("" : "+v"(a));
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) {
            __asm__ volatile("" : "+v"(b[i]));
            acc[i] = _mm512_dpbusd_epi32(acc[i], a, b[i]);
          }
        }
        rounds += 100000;
        spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      }
      int sink = 0;
      for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
      out[2 * t] = rounds * 12.0 * 64.0 + (sink == 42 ? 1.0 : 0.0);
      out[2 * t + 1] = spent;
    }
  });
  return out;
}
#else
std::vector<double> dot_peak(int64_t, double) { return {}; }
#endif
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dot_peak", &dot_peak); }
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None,
                   help="threads run at once (default: torch's thread count)")
    p.add_argument("--seconds", type=float, default=0.5)
    args = p.parse_args(argv)
    if (args.threads is not None and args.threads < 1) or not 0 < args.seconds < 600:
        p.error("--threads must be positive and --seconds between 0 and 600")
    import torch
    from torch.utils.cpp_extension import load_inline

    from tierserve.engine.calibrate import cpu_model
    from tierserve.model import kernels

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    # built as the kernels are
    module = load_inline(name="tierserve_dot_peak", cpp_sources=[SOURCE],
                         extra_cflags=kernels._FLAGS, extra_ldflags=["-fopenmp"])
    begin = time.perf_counter()
    counts = module.dot_peak(threads, args.seconds)
    wall = time.perf_counter() - begin
    if not counts:
        print("dot_peak: this CPU (or compiler) has no AVX-512 VNNI", file=sys.stderr)
        return 1
    done, spent = counts[::2], counts[1::2]
    per_thread = " ".join(f"{n / s / 1e9:.1f}" for n, s in zip(done, spent))
    print(f"dot_peak cpu='{cpu_model()}' machine={platform.machine()} threads={threads} "
          f"seconds={args.seconds} instruction=vpdpbusd_zmm gmac_s={sum(done) / wall / 1e9:.1f} "
          f"per_thread={per_thread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
