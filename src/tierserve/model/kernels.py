"""The CPU kernels, compiled once as one C++ extension: the paged decode attention
(cpu_attention.py), the quantized linear kernels (cpu_quant.py), random sampling
(cpu_sample.py) and the lean step (cpu_step.py).

NOTE: when they are built. `make install` (and `make serve`, which installs first) runs
`python -m tierserve.model.kernels`, so the extension is compiled when the package is
installed, not on the first request; it is cached under ~/.cache/torch_extensions (or
$TORCH_EXTENSIONS_DIR) and later processes load it in well under a second. A process that
finds no cached build compiles it on first use and says so in one line. Where it cannot be
had (no compiler or ninja, another platform) or with TIERSERVE_NO_KERNELS=1, `load()`
returns None with a one-line warning and the model runs on plain torch ops; on other
devices (CUDA) the kernels are never asked for.
"""

import logging
import os
import sys
import time

log = logging.getLogger(__name__)

NAME = "tierserve_cpu_kernels"
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
_KERNEL = None
_TRIED = False


def load():
    """The compiled extension module, or None when it cannot be had (then use torch)."""
    global _KERNEL, _TRIED
    if _TRIED:
        return _KERNEL
    _TRIED = True
    if os.environ.get("TIERSERVE_NO_KERNELS"):
        return None
    try:
        _KERNEL = _build()
    except Exception as exc:  # no compiler, no ninja, odd platform: fall back, loudly
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("CPU kernels unavailable (%s); using plain torch ops", first)
        _KERNEL = None
    return _KERNEL


PARTS = ("cpu_attention", "cpu_quant", "cpu_sample", "cpu_step")
"""The modules whose C++ `SOURCE` strings make the extension, in order (cpu_step's ends
with the bindings of all of them)."""


def source() -> str:
    """The extension's whole C++ source."""
    import importlib

    return "".join(importlib.import_module(f"tierserve.model.{part}").SOURCE for part in PARTS)


def _build():
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    built = os.path.exists(os.path.join(_get_build_directory(NAME, False), f"{NAME}.so"))
    if not built:
        log.warning("compiling the CPU kernels (once per machine, about a minute; "
                    "`make install` does this ahead)")
    return load_inline(name=NAME, cpp_sources=[source()],
                       verbose=False, extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"])


def main() -> int:
    """Build (or find) the extension and say where it is: one line, exit 1 if it failed."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    start = time.perf_counter()
    kernel = load()
    if kernel is None:
        print("tierserve: CPU kernels not built; the engine will use plain torch ops",
              file=sys.stderr)
        return 1
    print(f"tierserve: CPU kernels ready in {time.perf_counter() - start:.1f} s ({kernel.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
