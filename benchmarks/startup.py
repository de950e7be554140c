"""Time from `tierserve serve` to ready (`/health` answers 200), from nothing prepared, as
`make install` leaves it, and warm.

    python benchmarks/startup.py [--rounds 2] [--quantization none] [--port 8431]

Each start is a new process with its own empty caches where the case says so:
  - nothing:   no compiled kernels, no cached calibration or tokenizer (a user who
               skipped the install steps): compiles, calibrates, serves;
  - installed: what `make install` prepares (both steps timed too): the kernels built
               (`python -m tierserve.model.kernels`) and this machine's step times
               measured for the configuration (`tierserve calibrate --for-serve`);
  - warm:      the same caches a second time.
The page cache is dropped before each start where the machine lets us (root, and
/proc/sys/vm/drop_caches writable), so a start reads the model file from disk; the
output says whether it could. One line per case, the median of `--rounds` starts.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from side_by_side import wait_ready


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def start_to_ready(args, env: dict, timeout_s: float = 300.0) -> float:
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(args.port), "--quantization", args.quantization,
           "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        return wait_ready(args.port, proc, timeout_s, path="/health", poll_s=0.05)
    except RuntimeError as exc:
        tail = proc.stderr.read()[-500:] if proc.poll() is not None else ""
        raise RuntimeError(f"{exc} {tail}".strip()) from None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantization", default="none")
    p.add_argument("--port", type=int, default=8431)
    args = p.parse_args(argv)
    dropped = drop_page_cache()
    print(f"# startup machine={platform.machine()} cpus={os.cpu_count()} "
          f"quantization={args.quantization} rounds={args.rounds} "
          f"page_cache_dropped={'yes' if dropped else 'no (not permitted)'}", flush=True)
    results = {"nothing": [], "installed": [], "warm": []}
    build, calibration = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as ext, tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext, TIERSERVE_CACHE_DIR=cache)
            drop_page_cache()
            results["nothing"].append(start_to_ready(args, env))
        with tempfile.TemporaryDirectory() as ext, tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext, TIERSERVE_CACHE_DIR=cache)
            begin = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tierserve.model.kernels"], env=env,
                           check=True, capture_output=True)
            build.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tierserve.cli", "calibrate", "--for-serve",
                            "--quantization", args.quantization], env=env, check=True,
                           capture_output=True)
            calibration.append(time.perf_counter() - begin)
            drop_page_cache()
            results["installed"].append(start_to_ready(args, env))
            drop_page_cache()
            results["warm"].append(start_to_ready(args, env))
    print(f"startup kernel build at install (python -m tierserve.model.kernels): "
          f"{statistics.median(build):.1f} s; calibration at install (tierserve calibrate "
          f"--for-serve): {statistics.median(calibration):.1f} s", flush=True)
    for case, times in results.items():
        print(f"startup case={case} ready_s={statistics.median(times):.1f} "
              f"(runs: {', '.join(f'{t:.1f}' for t in times)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
