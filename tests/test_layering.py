"""The layering rules of docs/design.md ("Layers"), each one a test: a rule broken by a new
import fails here, naming the module and what it imported."""

import subprocess
import sys
import textwrap

from layering import import_graph, strongly_connected

TORCH_FREE = ("tierserve.core", "tierserve.metering", "tierserve.sim", "tierserve.hardware",
              "tierserve.forecast", "tierserve.route", "tierserve.batch", "tierserve.router.flow",
              "tierserve.router.remote", "tierserve.router.fleet", "tierserve.tiers",
              "tierserve.structured", "tierserve.schedule", "tierserve.tables", "tierserve.db",
              "tierserve.errors", "tierserve.config", "tierserve.sampling_params",
              "tierserve.engine_args", "tierserve.model.metadata", "tierserve.model.shapes",
              "tierserve.vllm", "tierserve.vllm.config", "tierserve.vllm.costs",
              "tierserve.vllm.meter", "tierserve.epp",
              "tierserve.server.app", "tierserve.server.protocol", "tierserve.server.tools")
"""Importing these (every module of a package) must not import torch."""

NEVER = {
    "tierserve.core": ("tierserve.engine", "tierserve.worker", "tierserve.model",
                       "tierserve.router", "tierserve.server", "tierserve.metering",
                       "tierserve.sim"),
    "tierserve.metering": ("tierserve.engine", "tierserve.worker", "tierserve.model",
                           "tierserve.router", "tierserve.server", "tierserve.sim"),
    "tierserve.sim": ("tierserve.engine", "tierserve.worker", "tierserve.server",
                      "tierserve.bench", "tierserve.cli"),
    "tierserve.forecast": ("tierserve.sim", "tierserve.server", "tierserve.engine"),
    "tierserve.batch": ("tierserve.server", "tierserve.engine", "tierserve.router"),
    "tierserve.server": ("tierserve.sim", "tierserve.forecast", "tierserve.bench",
                         "tierserve.cli", "tierserve.worker"),
    "tierserve.router": ("tierserve.server", "tierserve.sim", "tierserve.worker"),
    "tierserve.router.fleet": ("tierserve.engine", "tierserve.model.loader"),
    "tierserve.route": ("tierserve.server", "tierserve.router", "tierserve.engine"),
    "tierserve.hardware": ("tierserve.sim", "tierserve.server", "tierserve.engine",
                           "tierserve.metering", "tierserve.router"),
    "tierserve.schedule": ("tierserve.sim", "tierserve.server", "tierserve.core.scheduler"),
    "tierserve.epp": ("tierserve.engine", "tierserve.worker", "tierserve.model.loader",
                      "tierserve.sim", "tierserve.bench", "tierserve.cli"),
    "tierserve.vllm": ("tierserve.engine", "tierserve.worker", "tierserve.model",
                       "tierserve.server", "tierserve.router", "tierserve.sim",
                       "tierserve.bench", "tierserve.cli", "tierserve.batch"),
}
"""Package (or module) -> what it must never import: the layers of docs/design.md."""

LEAVES = ("tierserve.tiers", "tierserve.errors", "tierserve.structured", "tierserve.tables",
          "tierserve.db")
"""Modules that import nothing of the package but other leaves."""


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_import_circles_between_modules():
    circles = [c for c in strongly_connected(import_graph()) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def test_packages_import_in_one_direction():
    """No two packages (or top-level modules) of tierserve import each other."""
    graph = import_graph()

    def unit(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2])

    edges = {(unit(a), unit(b)) for a, deps in graph.items() for b in deps
             if unit(a) != unit(b)}
    both = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not both, f"packages importing each other: {both}"


def test_each_layer_imports_only_what_is_below_it():
    broken = []
    for module, imported in import_graph().items():
        for layer, forbidden in NEVER.items():
            if not _under(module, layer):
                continue
            for target in imported:
                if any(_under(target, f) for f in forbidden):
                    broken.append(f"{module} imports {target}")
    assert not broken, "\n".join(broken)


def test_leaves_import_only_leaves():
    graph = import_graph()
    broken = [f"{leaf} imports {target}" for leaf in LEAVES for target in graph[leaf]
              if target not in LEAVES]
    assert not broken, "\n".join(broken)


def test_torch_free_modules_import_without_torch():
    """Every module of the torch-free layers imports with torch kept out (the simulator,
    the planner, a fleet gateway and the vLLM plugin run without it)."""
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        for name in {TORCH_FREE!r}:
            mod = importlib.import_module(name)
            if name == "tierserve.vllm":
                continue  # its scheduler and middleware run inside vLLM (tests there)
            for info in pkgutil.walk_packages(getattr(mod, "__path__", []), name + "."):
                importlib.import_module(info.name)
        from tierserve.model.metadata import default_model_path, resolve
        assert resolve(default_model_path()).num_layers == 30  # a real GGUF's shape
        assert "torch" not in sys.modules, "torch imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_the_gateway_serves_without_importing_torch():
    """`tierserve serve --backend URL` in front of a replica (the minimal upstream), one
    completion through it; torch must not be in the process afterwards."""
    code = textwrap.dedent("""
        import json, os, socket, sys, threading, time, urllib.request
        import uvicorn
        from tierserve.bench import stub_upstream
        from tierserve.cli import main

        def port():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        up, gw = port(), port()
        threading.Thread(target=uvicorn.run, args=(stub_upstream.app,),
                         kwargs={"host": "127.0.0.1", "port": up, "log_level": "error"},
                         daemon=True).start()

        def client():
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    body = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 1}).encode()
                    req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=5) as r:
                        text = json.load(r)["choices"][0]["text"]
                    print("answered", repr(text), "torch" in sys.modules, flush=True)
                    os._exit(0 if "torch" not in sys.modules else 3)
                except OSError:
                    time.sleep(0.1)
            os._exit(2)

        threading.Thread(target=client, daemon=True).start()
        main(["serve", "--backend", f"http://127.0.0.1:{up}", "--port", str(gw),
              "--served-model-name", "stub", "--no-ledger", "--no-batches",
              "--disable-uvicorn-access-log"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "answered ' ok'" in out.stdout, out.stdout + out.stderr[-2000:]
    assert out.returncode == 0, "the gateway imported torch:\n" + out.stdout
