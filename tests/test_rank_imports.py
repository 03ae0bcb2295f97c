"""What :mod:`zerogpu.rank_zygote` imports before forking the ranks (``RANK_IMPORTS``): every listed
module is imported there, and none of them starts a thread, a process group or CUDA at import (a
fork would copy a thread's state without the thread).

Each check runs in a fresh interpreter (for the preload, one that imports ``torch.distributed`` first,
as the forking process does) and counts its native threads before and after each import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerogpu.launch import torch_unavailable_reason

TORCH_REASON = torch_unavailable_reason()
pytestmark = pytest.mark.skipif(TORCH_REASON is not None, reason=f"torch unavailable: {TORCH_REASON}")

ROOT = Path(__file__).resolve().parents[1]

# argv[1]: "preload" (run rank_zygote.preload on each program of argv[2:]) or "modules" (import
# argv[2:] in turn); prints {"imported": [...], "side_effects": {module: what}} as JSON
_PROBE = textwrap.dedent("""
    import importlib, json, os, sys

    def threads():
        return len(os.listdir("/proc/self/task"))

    def what_changed(before):
        found = []
        if threads() != before:
            found.append(f"native threads {before} -> {threads()}")
        if "torch" in sys.modules:
            import torch
            import torch.distributed as dist
            if dist.is_initialized():
                found.append("a process group")
            if torch.cuda.is_initialized():
                found.append("CUDA")
        return ", ".join(found)

    mode, names = sys.argv[1], sys.argv[2:]
    if mode == "preload":
        import torch.distributed  # what the forking process imports first
    side_effects, imported = {}, []
    for name in names:
        before = threads()
        if mode == "preload":
            from zerogpu.rank_zygote import RANK_IMPORTS, preload
            preload(["-m", name])
            listed = getattr(importlib.import_module(name), RANK_IMPORTS)
            imported += [m for m in listed if m in sys.modules]
        else:
            importlib.import_module(name)
            imported.append(name)
        changed = what_changed(before)
        if changed:
            side_effects[name] = changed
    print(json.dumps({"imported": imported, "side_effects": side_effects}))
""")


def _probe(mode: str, names: list[str], path: Path = ROOT) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode, *names], cwd=path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(path)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_preload_imports_every_listed_module_without_side_effects():
    import zerogpu
    import zerosim.verify

    listed = [*zerosim.verify.RANK_IMPORTS, *zerogpu.RANK_IMPORTS]
    seen = _probe("preload", ["zerosim.verify", "zerogpu"])
    assert sorted(seen["imported"]) == sorted(listed), "a listed module did not import before the fork"
    assert seen["side_effects"] == {}, f"a preloaded module has a side effect: {seen['side_effects']}"


# argv[1]: a verify run file; runs rank_zygote.preload on ``-m zerosim.verify --run-file FILE`` and prints
# {"imported": [the launch's modules now imported], "side_effects": what changed} as JSON
_LAUNCH_PROBE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from zerogpu.rank_zygote import preload
    import zerosim.verify

    argv = ["-m", "zerosim.verify", "--run-file", sys.argv[1]]
    names = zerosim.verify.launch_imports(argv[2:])
    preload(["-m", "zerosim.verify"])  # every launch's imports first, then this launch's
    before = len(os.listdir("/proc/self/task"))
    preload(argv)
    found = []
    if len(os.listdir("/proc/self/task")) != before:
        found.append("native threads")
    if dist.is_initialized():
        found.append("a process group")
    if torch.cuda.is_initialized():
        found.append("CUDA")
    print(json.dumps({"names": list(names), "imported": [n for n in names if n in sys.modules],
                      "side_effects": found}))
""")


def _launch_probe(tmp_path: Path, target: str, device: str = "cpu") -> dict:
    run = tmp_path / f"{target}-{device}.json"
    run.write_text(json.dumps({"format": "zerosim-verify-run/1", "target": target, "device": device}))
    proc = subprocess.run([sys.executable, "-c", _LAUNCH_PROBE, str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_deepspeed_launch_on_the_cpu_imports_deepspeed_once_before_the_fork(tmp_path):
    """DeepSpeed's ranks import DeepSpeed and its Muon module (torch.compile's compiler): the zygote of a
    CPU launch imports them before forking, with no thread, process group or CUDA started."""
    pytest.importorskip("deepspeed")
    from zerosim.verify.adapters import CPU_RANK_IMPORTS

    seen = _launch_probe(tmp_path, "deepspeed-2")
    assert seen["names"] == list(CPU_RANK_IMPORTS["deepspeed-2"])
    assert seen["imported"] == seen["names"], "a launch import did not import before the fork"
    assert seen["side_effects"] == [], f"a launch import has a side effect: {seen['side_effects']}"


def test_other_launches_import_nothing_more(tmp_path):
    import zerosim.verify

    for target, device in (("ddp", "cpu"), ("deepspeed-2", "cuda")):
        run = tmp_path / f"{target}-{device}.json"
        run.write_text(json.dumps({"target": target, "device": device}))
        assert zerosim.verify.launch_imports(["--run-file", str(run)]) == (), (target, device)
    assert zerosim.verify.launch_imports(["--settings", str(run)]) == ()
    assert zerosim.verify.launch_imports(["--run-file", str(tmp_path / "missing.json")]) == ()


def test_the_probe_names_a_module_that_starts_a_thread(tmp_path):
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    (tmp_path / "quiet.py").write_text("VALUE = 1\n")
    seen = _probe("modules", ["quiet", "starts_a_thread"], tmp_path)
    assert list(seen["side_effects"]) == ["starts_a_thread"]
    assert "native threads" in seen["side_effects"]["starts_a_thread"]
