"""``zerosim gpu-check``: one prepared command that proves the CUDA paths on one GPU, within 8 minutes.

Six steps, each in its own process group with its own wall-clock limit (killed whole when it outlives
it, :func:`zerosim.processes.launching.run_process_group`), all within :data:`TOTAL_LIMIT_S`:

1. ``tests``: the GPU tests (:data:`GPU_TESTS`, marker ``gpu``) under pytest;
2. ``report``: ``python -m zerogpu report --world-size 1``: the engine on the device against the
   ground truth, every strategy;
3. ``trainer``: ZeroTrainer on the device against the same run on the CPU, every strategy
   (:mod:`zerosim.bench.trainer_devices`: bitwise where the kernels are the same, else within the
   derived bound);
4. ``offload``: ``zerosim bench offload`` on the device (device peak against its budget, prefetch
   overlap as a fraction of copy time, step time with and without offload);
5. ``kernel``: the AdamW update's throughput against the device's copy bandwidth
   (:mod:`zerosim.bench.optimizer_bandwidth`);
6. ``verify``: ``zerosim verify`` on the device, the built-in peers at world 1
   (:mod:`zerosim.bench.verify_devices`).

Everything goes to one folder: ``gpu-check.json`` (every step's status, wall time, limit and figures,
the device and versions), ``gpu-check.md``, ``gpu-check.png`` and ``steps/`` (each step's own output
and log). ``--cpu`` runs the same steps on the CPU at sizes that take seconds (what CI runs).

Exit status: 0 every step passed or was skipped for a stated reason; 1 a step failed (named on the
last line); 124 a step outlived its limit (and none failed); 2 bad input or no CUDA without ``--cpu``.

Why one module of this length: the six steps, their limits and sizes and the folder they fill are
one prepared command; the steps' own work lives in the modules each step starts.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import resource
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EXIT_CONTRACT_FAILED, EXIT_LAUNCH_TIMEOUT, EXIT_OK, ConfigError
from ..processes.launching import GroupRun, run_process_group
from .gpu_session import write_json

TOTAL_LIMIT_S = 480.0  #: the whole check on a GPU: 8 minutes
#: ``--cpu`` gives every limit this factor: the small sizes take seconds on an idle machine, but a shared
#: CI machine under load may be several times slower (a timeout there says nothing about a GPU run)
CPU_LIMIT_SCALE = 2.0
MIN_STEP_S = 5.0  #: a step that would get less than this of the total is not started
PERTURB_ENV = "ZEROSIM_GPU_CHECK_PERTURB"  #: a step name: that step's comparison sees a perturbed value
PERTURBABLE = ("trainer", "kernel")
#: the GPU tests: the engine, NCCL and the report; the offload manager's pinned copies on a side stream;
#: the monitor's digest and live runs on the device; the host optimizer stepping a gradient copied
#: down into pinned memory, and gradient shards copied down on a side stream piece by piece; the
#: compiled optimizer kernel against the rounding bound; the reference optimizer's one Triton pass
#: against the CPU's bits
GPU_TESTS = (Path("tests") / "test_zerogpu_gpu.py", Path("tests") / "test_zerogpu_offload.py",
             Path("tests") / "test_monitor_gpu.py", Path("tests") / "test_zerogpu_host_optimizer.py",
             Path("tests") / "test_zerogpu_compiled_kernel.py",
             Path("tests") / "test_zerogpu_offload_gradients.py",
             Path("tests") / "test_zerogpu_triton_kernel.py")

#: each step's size on a GPU (realistic) and on the CPU (seconds on two cores)
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "cuda": {"report": {"model": "tiny", "steps": 2, "micro_batches": 2},
             "trainer": {"model": "gpt", "steps": 4},
             "offload": {"model": "gpt-50m", "steps": 4, "warmup": 1},
             "kernel": {"elements": 1 << 26, "repeats": 10},
             "verify": {"steps": 8}},
    "cpu": {"report": {"model": "tiny", "steps": 1, "micro_batches": 1},
            "trainer": {"model": "gpt", "steps": 2},
            "offload": {"model": "gpt", "steps": 1, "warmup": 0},
            "kernel": {"elements": 1 << 16, "repeats": 2},
            "verify": {"steps": 4}},
}


@dataclass
class Context:
    """Where a run writes, on which device, at which sizes."""

    out: Path
    device: str  # "cuda" or "cpu"
    perturb: str | None
    repo: Path | None  # the source tree the GPU tests live in, if there is one

    @property
    def steps_dir(self) -> Path:
        return self.out / "steps"

    def size(self, step: str) -> dict[str, Any]:
        return SIZES[self.device][step]

    @property
    def limit_scale(self) -> float:
        return CPU_LIMIT_SCALE if self.device == "cpu" else 1.0


@dataclass
class StepResult:
    """One step as the report shows it: ``status`` pass / fail / skipped / timeout, and why."""

    name: str
    title: str
    status: str
    reason: str
    wall_s: float
    limit_s: float
    command: list[str]
    figures: dict[str, float]
    artifact: str | None = None
    log: str | None = None
    cpu_s: float = 0.0  #: host CPU time (user + system) of the step's processes


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    limit_s: float
    #: (context, limit) -> argv, or why the step is skipped without running anything
    command: Callable[[Context, float], list[str] | str]
    read: Callable[[Context, GroupRun], tuple[str, str, dict[str, float]]]  # (status, reason, figures)
    artifact: Callable[[Context], Path]


def find_repo() -> Path | None:
    """The source tree the package was installed from (editable or a checkout), if its tests are there."""
    root = Path(__file__).resolve().parents[2]
    return root if all((root / path).is_file() for path in GPU_TESTS) else None


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


# ---- 1. the GPU tests ---------------------------------------------------------------------------
def _tests_command(ctx: Context, limit_s: float) -> list[str] | str:
    if ctx.repo is None:
        return f"tests not found ({', '.join(map(str, GPU_TESTS))} beside the package)"
    import torch

    if not torch.cuda.is_available():  # --cpu on a machine without CUDA: every GPU test would skip
        return ("no CUDA device visible to torch: every GPU test would skip, so pytest is not run (the "
                "test suite collects the GPU tests and skips them the same way)")
    return _python("-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                   "-p", "no:xdist", "-p", "no:hypothesispytest",  # plugins the GPU tests do not use
                   f"--rootdir={ctx.repo}", f"--junitxml={ctx.steps_dir / 'tests.xml'}",
                   *(str(ctx.repo / path) for path in GPU_TESTS))


def _tests_read(ctx: Context, run: GroupRun) -> tuple[str, str, dict[str, float]]:
    path = ctx.steps_dir / "tests.xml"
    if not path.is_file():
        return "fail", f"pytest wrote no results (exit {run.returncode}): {_last_line(run)}", {}
    root = ElementTree.parse(path).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    if suite is None:
        return "fail", f"pytest's results hold no test suite (exit {run.returncode})", {}
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figures = {"passed": float(passed), **{k: float(v) for k, v in counts.items()}}
    if counts["failures"] or counts["errors"] or run.returncode not in (0, 5):
        names = [c.get("name", "?") for c in suite.iter("testcase")
                 if c.find("failure") is not None or c.find("error") is not None]
        bad = counts["failures"] + counts["errors"]
        return "fail", f"{bad} failed: {', '.join(names) or _last_line(run)}", figures
    if passed == 0:
        reasons = sorted({(s.get("message") or "").strip() for s in suite.iter("skipped")} - {""})
        why = "; ".join(reasons) or "no test selected"
        return "skipped", f"all {counts['tests']} skipped: {why}", figures
    return "pass", f"{passed} passed, {counts['skipped']} skipped", figures


# ---- 2. the engine on the device against the ground truth -----------------------------------------
def _report_command(ctx: Context, limit_s: float) -> list[str]:
    s = ctx.size("report")
    cmd = _python("-m", "zerogpu", "report", "--world-size", "1", "--strategies", "all",
                  "--model", s["model"], "--steps", str(s["steps"]),
                  "--micro-batches", str(s["micro_batches"]), "--out", str(ctx.steps_dir / "report"),
                  "--launch-timeout", f"{max(limit_s - 10, 1):.0f}")  # torchrun ends first and says so
    return cmd + (["--cpu"] if ctx.device == "cpu" else [])


def _report_read(ctx: Context, run: GroupRun) -> tuple[str, str, dict[str, float]]:
    doc = _load(ctx.steps_dir / "report" / "equivalence.json")
    if doc is None:
        return "fail", f"no report (exit {run.returncode}): {_last_line(run)}", {}
    figures: dict[str, float] = {}
    for r in doc["runs"]:
        if r["max_abs_error_vs_ground_truth"] is not None:
            figures[f"{r['strategy']}.max_abs_error_vs_ground_truth"] = r["max_abs_error_vs_ground_truth"]
        figures[f"{r['strategy']}.max_abs_diff_vs_simulator"] = r["vs_simulator"]["max_abs_diff"]
    failed = [r["strategy"] for r in doc["runs"]
              if not (r["contracts_passed"] and r["vs_simulator"]["agrees"])]
    if failed or not doc["passed"] or run.returncode != 0:
        return "fail", f"strategies that failed a contract or disagree with the simulator: {failed}", figures
    return "pass", (f"{len(doc['runs'])} strategies: every contract held, every run agrees with the "
                    "simulator"), figures


# ---- 3. ZeroTrainer on the device against the CPU -------------------------------------------------
def _trainer_command(ctx: Context, limit_s: float) -> list[str]:
    s = ctx.size("trainer")
    cmd = _python("-m", "zerosim.cli.gpu_check_steps", "trainer_devices", "--device", ctx.device,
                  "--model", s["model"], "--steps", str(s["steps"]),
                  "--out", str(ctx.steps_dir / "trainer.json"))
    return cmd + (["--perturb"] if ctx.perturb == "trainer" else [])


def _trainer_read(ctx: Context, run: GroupRun) -> tuple[str, str, dict[str, float]]:
    doc = _load(ctx.steps_dir / "trainer.json")
    if doc is None:
        return "fail", f"no result (exit {run.returncode}): {_last_line(run)}", {}
    figures = {}
    for r in doc["runs"]:
        figures[f"{r['strategy']}.error_over_bound"] = r["error_over_bound"]
        figures[f"{r['strategy']}.max_abs_diff"] = r["max_abs_diff"]
        figures[f"{r['strategy']}.device_vs_reference_over_bound"] = r["device_vs_reference_over_bound"]
    how = ", ".join(f"{r['strategy']} {r['comparison']}" for r in doc["runs"])
    failed = [f"{r['strategy']}: {r['problems'][0]}" for r in doc["runs"] if not r["passed"]]
    if failed or run.returncode != 0:
        return "fail", "; ".join(failed) or _last_line(run), figures
    worst = max(r["error_over_bound"] for r in doc["runs"])
    return "pass", f"{how}; largest error/bound {worst:.3g}", figures


# ---- 4. offload on the device ---------------------------------------------------------------------
def _offload_command(ctx: Context, limit_s: float) -> list[str]:
    s = ctx.size("offload")
    return _python("-m", "zerosim", "bench", "offload", "--device", ctx.device, "--model", s["model"],
                   "--steps", str(s["steps"]), "--warmup", str(s["warmup"]),
                   "--out", str(ctx.steps_dir / "bench_offload.json"))


def _offload_read(ctx: Context, run: GroupRun) -> tuple[str, str, dict[str, float]]:
    from zerogpu.trainer import OFFLOAD_ON_DEVICE_REFUSED

    doc = _load(ctx.steps_dir / "bench_offload.json")
    if doc is None and OFFLOAD_ON_DEVICE_REFUSED in _last_line(run):  # ZeroTrainer's refusal on this device
        return "skipped", f"not supported here: {_last_line(run).removeprefix('error: ')}", {}
    if doc is None:
        return "fail", f"no result (exit {run.returncode}): {_last_line(run)}", {}
    perf, med = doc["performance_stats"], doc["median_step_s"]
    figures = {
        "device_peak_bytes": doc["device_peak_bytes"], "device_budget_bytes": doc["device_budget_bytes"],
        "peak_over_budget": doc["device_peak_bytes"] / doc["device_budget_bytes"],
        "overlap_fraction": perf["overlap_fraction"], "seconds_copying": perf["seconds_copying"],
        "step_s_without_offload": med["plain"], "step_s_with_offload": med["offload"],
        "offload_over_plain": doc["offload_over_plain"],
    }
    problems = []
    if doc["device_peak_bytes"] > doc["device_budget_bytes"]:
        problems.append(f"device peak {doc['device_peak_bytes']:,} B over its budget "
                        f"{doc['device_budget_bytes']:,} B")
    if not doc["bitwise_equal"]:
        problems.append("training with offload is not bitwise equal to training without")
    if problems or run.returncode != 0:
        return "fail", "; ".join(problems) or _last_line(run), figures
    return "pass", (f"peak {figures['peak_over_budget']:.2f} of the budget, overlap "
                    f"{perf['overlap_fraction']:.2f} of copy time, step {med['offload'] / med['plain']:.2f}x "
                    "with offload, bitwise equal"), figures


# ---- 5. the AdamW kernel against the copy bandwidth -----------------------------------------------
def _kernel_command(ctx: Context, limit_s: float) -> list[str]:
    s = ctx.size("kernel")
    cmd = _python("-m", "zerosim.cli.gpu_check_steps", "optimizer_bandwidth", "--device", ctx.device,
                  "--elements", str(s["elements"]), "--repeats", str(s["repeats"]),
                  "--out", str(ctx.steps_dir / "kernel.json"))
    return cmd + (["--perturb"] if ctx.perturb == "kernel" else [])


def _kernel_read(ctx: Context, run: GroupRun) -> tuple[str, str, dict[str, float]]:
    doc = _load(ctx.steps_dir / "kernel.json")
    if doc is None:
        return "fail", f"no result (exit {run.returncode}): {_last_line(run)}", {}
    figures = {"copy_bandwidth_gb_s": doc["copy_bandwidth_gb_s"]}
    for k in doc["kernels"]:
        figures[f"{k['kernel']}.fraction_of_copy"] = k["fraction_of_copy"]
        figures[f"{k['kernel']}.bandwidth_gb_s"] = k["bandwidth_gb_s"]
        figures[f"{k['kernel']}.error_over_bound"] = k["check"]["error_over_bound"]
    figures["monitor_digest.bandwidth_gb_s"] = doc["monitor_digest"]["bandwidth_gb_s"]
    figures["monitor_digest.fraction_of_copy"] = doc["monitor_digest"]["fraction_of_copy"]
    if doc["problems"] or run.returncode != 0:
        return "fail", "; ".join(doc["problems"]) or _last_line(run), figures
    judged = "" if doc["goal_judged"] else " (goal not judged on a CPU)"
    return "pass", (f"{doc['default_kernel']} kernel at {doc['default_fraction_of_copy']:.2f} of the copy "
                    f"bandwidth, goal {doc['goal']}{judged}; every kernel's result checked"), figures


# ---- 6. zerosim verify on the device ---------------------------------------------------------------
def _verify_command(ctx: Context, limit_s: float) -> list[str]:
    return _python("-m", "zerosim.cli.gpu_check_steps", "verify_devices", "--device", ctx.device,
                   "--steps", str(ctx.size("verify")["steps"]), "--out", str(ctx.steps_dir / "verify.json"))


def _verify_read(ctx: Context, run: GroupRun) -> tuple[str, str, dict[str, float]]:
    doc = _load(ctx.steps_dir / "verify.json")
    if doc is None:
        return "fail", f"no result (exit {run.returncode}): {_last_line(run)}", {}
    figures = {f"{r['case']}.seconds": r["seconds"] for r in doc["runs"]}
    failed = [f"{r['case']}: {r['error'] or r['verdict']}" for r in doc["runs"] if r["verdict"] != "pass"]
    if failed or run.returncode != 0:
        return "fail", "; ".join(failed) or _last_line(run), figures
    cases = ", ".join(r["case"] for r in doc["runs"])
    return "pass", f"verify at world 1 passed: {cases}", figures


STEPS = (
    Step("tests", "GPU tests (pytest -m gpu)", 150.0, _tests_command, _tests_read,
         lambda c: c.steps_dir / "tests.xml"),
    Step("report", "engine on the device vs ground truth, every strategy", 60.0, _report_command,
         _report_read, lambda c: c.steps_dir / "report" / "equivalence.json"),
    Step("trainer", "ZeroTrainer on the device vs on the CPU, every strategy", 60.0, _trainer_command,
         _trainer_read, lambda c: c.steps_dir / "trainer.json"),
    Step("offload", "ZeRO-3 offload: peak vs budget, overlap, step time", 45.0, _offload_command,
         _offload_read, lambda c: c.steps_dir / "bench_offload.json"),
    Step("kernel", "AdamW update vs copy bandwidth", 45.0, _kernel_command, _kernel_read,
         lambda c: c.steps_dir / "kernel.json"),
    Step("verify", "zerosim verify on the device, the built-in peers at world 1", 120.0, _verify_command,
         _verify_read, lambda c: c.steps_dir / "verify.json"),
)
STEP_NAMES = tuple(s.name for s in STEPS)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_line(run: GroupRun) -> str:
    lines = [ln for ln in (run.stderr or "").splitlines() + (run.stdout or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("error:", "E ", "FAILED"))]
    return (errors or lines or ["no output"])[-1].strip()[:300]


def run_step(step: Step, ctx: Context, limit_s: float, env: dict[str, str]) -> StepResult:
    """One step in its own process group, killed when it outlives ``limit_s``; its output to a log."""
    command = step.command(ctx, limit_s)
    artifact = step.artifact(ctx)
    log = ctx.steps_dir / f"{step.name}.log"
    if isinstance(command, str):
        log.write_text(f"skipped, nothing run: {command}\n")
        return StepResult(step.name, step.title, "skipped", command, 0.0, limit_s, [], {},
                          log=str(log.relative_to(ctx.out)))
    before = _children_cpu_s()
    run = run_process_group(command, limit_s, env, capture=True)
    cpu_s = _children_cpu_s() - before
    log.write_text(f"$ {' '.join(command)}\n--- stdout\n{run.stdout or ''}\n--- stderr\n{run.stderr or ''}")
    if run.timed_out:
        figures: dict[str, float] = {}
        status, reason = "timeout", f"did not finish within {limit_s:.0f} s; killed it"
    else:
        status, reason, figures = step.read(ctx, run)
    rel = str(artifact.relative_to(ctx.out)) if artifact.exists() else None
    return StepResult(step.name, step.title, status, reason, run.elapsed_s, limit_s, command,
                      {k: float(v) for k, v in figures.items()}, rel, str(log.relative_to(ctx.out)), cpu_s)


def _children_cpu_s() -> float:
    """CPU seconds of every finished child process of this one (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def default_out() -> Path:
    return Path("reports") / f"gpu-check-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def parse_only(text: str | None) -> tuple[str, ...]:
    if text is None:
        return STEP_NAMES
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown or not names:
        raise ConfigError("only", text, f"steps: {', '.join(STEP_NAMES)}")
    return names


def prepare(args: Any) -> tuple[Context, tuple[str, ...]]:
    """Every check on the input before anything is written (ConfigError: exit 2, nothing created)."""
    only = parse_only(args.only)
    out = Path(args.out) if args.out is not None else default_out()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("out", str(out), "exists and is not an empty folder; name a new one")
    perturb = os.environ.get(PERTURB_ENV) or None
    if perturb is not None and perturb not in PERTURBABLE:
        raise ConfigError(PERTURB_ENV, perturb, f"must be one of {', '.join(PERTURBABLE)}")
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", f"gpu-check needs a CUDA device and torch sees none (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda}); run it on a GPU machine, "
                          "or pass --cpu to run the same steps on the CPU")
    return Context(out, "cpu" if args.cpu else "cuda", perturb, find_repo()), only


def run(args: Any) -> int:
    """The command: every selected step, then the folder's JSON, markdown and figure; the exit status."""
    from .gpu_check_report import write_figure, write_markdown
    from .gpu_session import describe_device

    ctx, only = prepare(args)
    ctx.steps_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop(PERTURB_ENV, None)
    started = time.monotonic()
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results: list[StepResult] = []
    for i, step in enumerate(STEPS, 1):
        total = TOTAL_LIMIT_S * ctx.limit_scale
        left = total - (time.monotonic() - started)
        if step.name not in only:
            result = StepResult(step.name, step.title, "skipped", "not selected (--only)", 0.0,
                                step.limit_s * ctx.limit_scale, [], {})
        elif left < MIN_STEP_S:
            result = StepResult(step.name, step.title, "timeout",
                                f"not started: {left:.0f} s left of the {total:.0f} s total",
                                0.0, 0.0, [], {})
        else:
            result = run_step(step, ctx, min(step.limit_s * ctx.limit_scale, left), env)
        results.append(result)
        print(f"[{i}/{len(STEPS)}] {step.name:<8} {result.status:<8} {result.wall_s:6.1f} s  {result.reason}",
              flush=True)
    failed = [r.name for r in results if r.status == "fail"]
    timed_out = [r.name for r in results if r.status == "timeout"]
    code = EXIT_CONTRACT_FAILED if failed else EXIT_LAUNCH_TIMEOUT if timed_out else EXIT_OK
    doc: dict[str, Any] = {
        "check": "gpu-check", "started_utc": stamp, "device": ctx.device,
        "environment": describe_device(ctx.device), "total_limit_s": TOTAL_LIMIT_S * ctx.limit_scale,
        "wall_s": time.monotonic() - started, "sizes": SIZES[ctx.device], "perturbed": ctx.perturb,
        "steps": [vars(r) for r in results], "failed": failed, "timed_out": timed_out,
        "passed": code == EXIT_OK, "exit_status": code,
    }
    write_json(ctx.out / "gpu-check.json", doc)
    write_markdown(ctx.out / "gpu-check.md", doc)
    write_figure(ctx.out / "gpu-check.png", doc)
    where = f"{ctx.out}/gpu-check.{{json,md,png}}"
    if failed:
        print(f"gpu-check: FAIL: step(s) {', '.join(failed)} failed; see {where}", file=sys.stderr)
    elif timed_out:
        print(f"gpu-check: TIMEOUT: step(s) {', '.join(timed_out)} outlived their limit; see {where}",
              file=sys.stderr)
    else:
        print(f"gpu-check: PASS on {doc['environment']['device_name']}; wrote {where}")
    return code
