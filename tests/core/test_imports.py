"""Every module of every package imports on its own, first thing in a fresh interpreter.

Why. The CLI loads one module per command (``kvshard model finetune`` imports ``kvshard_training.finetune``
and nothing before it), so an import cycle that the test run never trips — because some other module
happened to be imported first — breaks a command for its users (seen: finetune → isolated_scorer →
engine → isolated_scorer). One subprocess loads the heavy third-party packages, then forks a child per
module that imports it with none of the project's modules loaded: seconds, not an interpreter start
(and a torch import) per module.
"""

from __future__ import annotations

import json
import subprocess
import sys

ROOTS = ("kvshard", "kvshard_operator", "kvshard_sidecar", "kvshard_router", "kvshard_bench", "kvshard_local",
         "kvshard_training")
PRELOADED = ("torch", "transformers", "peft", "numpy", "kopf", "aiohttp", "prometheus_client", "yaml")

SCRIPT = """
import importlib, importlib.util, json, os, pkgutil, sys
for name in {preloaded!r}:
    importlib.import_module(name)
roots = {roots!r}
names = []
for root in roots:
    spec = importlib.util.find_spec(root)
    names.append(root)
    names += [m.name for m in pkgutil.walk_packages(spec.submodule_search_locations, root + ".")
              if not m.name.endswith(".__main__")]  # runs a program, not an import
for loaded in [k for k in sys.modules if k.split(".")[0] in roots]:  # walk_packages imports the packages
    del sys.modules[loaded]
failures = {{}}
for name in names:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = b""
        except BaseException as error:
            message = f"{{type(error).__name__}}: {{error}}".encode()[:4000]
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(child, 0)
    if message:
        failures[name] = message
print(json.dumps({{"modules": len(names), "failures": failures}}))
"""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(roots=ROOTS, preloaded=PRELOADED)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100
    assert report["failures"] == {}, "\n".join(f"{name}: {why}" for name, why in report["failures"].items())
