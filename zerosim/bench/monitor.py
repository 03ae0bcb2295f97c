"""``zerosim bench monitor``: what zerosim.monitor costs a training step, measured side by side.

One torchrun launch (:mod:`zerosim.bench.monitor_rank`) trains one MLP (``--width``, ``--depth``,
``--batch`` rows per rank and step) with each adapter (DDP, ZeroRedundancyOptimizer, FSDP2, zerogpu
ZeRO-3, and DeepSpeed ZeRO stages 1-3 where DeepSpeed is installed: otherwise each is a ``skipped`` row
naming why) without the monitor and with it in each monitored variant (``--variants``, default all of
:data:`VARIANTS`): ``every=100`` and ``every=1`` without the step clauses of C-ZERO-002, and
``every=100+step-checks``, ``every=1+step-checks`` with ``grad_accounting``, ``update`` and ``replay``
at every check, interleaved: per adapter and round, off, A, off, B, off, ... (the monitored variants'
order reversed every other round). Each monitored run's ratio is its step time over the mean of its two
neighbours without the monitor; per adapter and variant the median ratio over ``--rounds`` rounds and
its min-max, the ratio the monitor's own timed seconds account for (the step checks' hooks and replay
included), their ms per check per kind, and the ratio at the variant's ``every`` projected from the
cost per check measured at ``every=1``. Every monitored run is also a fault-free soak: its violations
are counted (0 expected). Per adapter, which step checks its runs carried, and the clauses the monitor
says are off for it and why. ``--trace``: every monitored run writes its observation files and each is
judged again offline (:mod:`zerosim.bench.monitor_trace`), beside the live verdict (files are written
and fsynced line by line, so leave it off where the ratios matter). In this process: the digest's throughput
(:func:`zerosim.monitor.digest.tensor_digest`) against a plain copy of the same bytes. ``--device
cuda`` trains on the GPUs (one per rank over NCCL; ranks beyond the GPUs share them over gloo) and
times the digest there.

Writes ``bench_monitor.json`` into a new ``reports/bench-monitor-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..files.outputs import output_dir, write_text
from .gpu_session import require_device
from .monitor_layout import layout_check_times
from .monitor_variants import ADAPTERS, OPTIONAL, VARIANTS

DEFAULT_OUT = "a new reports/bench-monitor-<timestamp>/"
JSON_NAME = "bench_monitor.json"
#: the step checks' kinds, timed apart (``fields``: reading a check's findings for its row)
STEP_KINDS = ("grad_accounting", "update", "replay", "fields")
DEFAULT_ADAPTERS = "ddp,zero-redundancy,fsdp2,zerogpu-zero3,deepspeed-1,deepspeed-2,deepspeed-3"
#: the default model and batch: 1.07M parameters, 256 rows of 16 per rank and step, about 1.6 GFLOP a
#: step per rank (tens of ms on one idle core), so the step does work a check can be weighed against
DEFAULT_WIDTH, DEFAULT_DEPTH, DEFAULT_BATCH = 512, 4, 256


def digest_throughput(megabytes: int, repeats: int = 9, device: str = "cpu") -> dict[str, float]:
    """GB/s of the digest and of a plain copy (``copy_`` into a buffer allocated beforehand, so neither
    pays for fresh pages) over one float32 tensor of ``megabytes`` MB on ``device``, the two timed
    alternately (the device synchronised around each), best of ``repeats`` each, and their ratio
    (digest time / copy time); on the CPU on one thread, as each rank of the launch runs (torchrun's
    ``OMP_NUM_THREADS=1``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _digest_and_copy(megabytes, repeats, torch.device(device))
    finally:
        torch.set_num_threads(threads)


def _digest_and_copy(megabytes: int, repeats: int, device: Any) -> dict[str, float]:
    import torch

    from ..monitor.digest import tensor_digest
    from .gpu_session import synchronize

    x = torch.randn(megabytes * 2**20 // 4).to(device)
    destination = torch.empty_like(x)
    tensor_digest(x)
    destination.copy_(x)
    digest_s = copy_s = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        tensor_digest(x)
        synchronize(device)
        t1 = time.perf_counter()
        destination.copy_(x)
        synchronize(device)
        t2 = time.perf_counter()
        digest_s, copy_s = min(digest_s, t1 - t0), min(copy_s, t2 - t1)
    gb = x.numel() * 4 / 1e9
    return {"megabytes": megabytes, "digest_gb_s": gb / digest_s, "copy_gb_s": gb / copy_s,
            "digest_over_copy": digest_s / copy_s}


def summarize(rows: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Per adapter and variant: each monitored run's ratio to the mean of the runs without the monitor
    just before and after it in the same round (``position`` +-1); the median ratio and its min-max over
    rounds; the median seconds per step; the monitor's checks, violations, mean ms per timed check and
    first check (which gathers the layout once); ``accounted``: 1 + the monitor's own time per step
    over the step time without it (the ratio the checks alone explain, free of the step time's noise),
    the step checks' hooks and replay included (``step_check_s``). With step checks, also
    ``step_check_carried`` (the check steps the probe observed in the timed steps, and per kind those
    whose fields carried its finding), ``step_check_ms`` (per kind, ms per observed check step; None
    where none was observed) and ``all_check_ms`` (``check_ms`` plus them).
    ``off`` rows: ratio 1 and the spread of the runs without the monitor around their median.
    Then :func:`project`."""
    out = []
    for adapter in dict.fromkeys(r["adapter"] for r in rows):
        mine = [r for r in rows if r["adapter"] == adapter]
        off = [r for r in mine if r["variant"] == "off"]
        base = statistics.median(r["step_s"] for r in off)
        out.append({"adapter": adapter, "variant": "off", "step_ms": base * 1e3, "ratio": 1.0,
                    "ratio_min": min(r["step_s"] for r in off) / base,
                    "ratio_max": max(r["step_s"] for r in off) / base, "accounted": 1.0,
                    "runs": len(off), "checks": 0, "violations": 0, "check_ms": 0.0, "first_check_ms": 0.0,
                    "local_params": off[0]["local_params"]})
        neighbours = {(r["round"], r["position"]): r["step_s"] for r in off}
        for variant in [v for v in VARIANTS if v != "off"]:
            runs = [r for r in mine if r["variant"] == variant]
            if not runs:
                continue
            ratios, accounted = [], []
            for r in runs:
                around = [neighbours[(r["round"], r["position"] + d)] for d in (-1, 1)
                          if (r["round"], r["position"] + d) in neighbours]
                baseline = statistics.mean(around)
                ratios.append(r["step_s"] / baseline)
                accounted.append(1 + (r["monitor_s"] + sum(r.get("step_check_s", {}).values())) / steps
                                 / baseline)
            checks = sum(r["checks"] for r in runs)
            row = {"adapter": adapter, "variant": variant,
                   "step_ms": statistics.median(r["step_s"] for r in runs) * 1e3,
                   "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                   "ratio_max": max(ratios),
                   "accounted": statistics.median(accounted), "runs": len(runs), "checks": checks,
                   "violations": sum(r["violations"] for r in runs),
                   "check_ms": 1e3 * sum(r["monitor_s"] for r in runs) / max(1, checks),
                   "first_check_ms": 1e3 * statistics.median(r["first_check_s"] for r in runs),
                   "local_params": runs[0]["local_params"]}
            if "step_check_s" in runs[0]:
                carried = {k: sum(r["step_check_carried"].get(k, 0) for r in runs)
                           for k in ("observed", *STEP_KINDS[:-1])}
                # per check step observed; none observed (an every=100 run too short to hold one): no
                # figure per check, the seconds of the steps not due still count in accounted
                row["step_check_ms"] = None if not carried["observed"] else {
                    k: 1e3 * sum(r["step_check_s"].get(k, 0.0) for r in runs) / carried["observed"]
                    for k in STEP_KINDS}
                row["all_check_ms"] = None if row["step_check_ms"] is None else \
                    row["check_ms"] + sum(row["step_check_ms"].values())
                row["step_check_carried"] = carried
                row["step_checks_off"] = runs[0].get("step_checks_off")
            out.append(row)
    return project(out)


def project(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each monitored row's ``projected`` ratio at its ``every``: 1 + the cost of one check over
    ``every`` steps without the monitor, ``1 + ms / (every x off step ms)``; the cost per check is the
    one measured in the variant of the same adapter and step-check setting with the most timed checks
    (``projected_from``; ``every=1`` where it ran), so that ``every=100`` runs too short to hold a timed
    check are still weighed. The first check of a run (the layout gathered once) is left out."""
    off = {r["adapter"]: r["step_ms"] for r in table if r["variant"] == "off"}
    for row in table:
        spec = VARIANTS[row["variant"]]
        if spec is None:
            continue
        family = [r for r in table if r["adapter"] == row["adapter"] and VARIANTS[r["variant"]] is not None
                  and VARIANTS[r["variant"]][1] == spec[1] and r["checks"] > 0  # type: ignore[index]
                  and r.get("step_check_ms", {}) is not None]
        if not family:
            row["projected"] = row["projected_from"] = None
            continue
        source = max(family, key=lambda r: r["checks"])
        cost = source.get("all_check_ms", source["check_ms"])
        row["projected"] = 1 + cost / (spec[0] * off[row["adapter"]])
        row["projected_from"] = source["variant"]
    return table


def step_check_support(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per adapter measured with step checks, from its variant with the most check steps observed: those
    steps (``observed``), for each step clause the ones whose fields carried its finding (0: off for
    that adapter), and the monitor's own line saying which are off and why."""
    support: dict[str, dict[str, Any]] = {}
    for row in table:
        best = support.get(row["adapter"])
        observed = row.get("step_check_carried", {}).get("observed", 0)
        if observed > (best["observed"] if best else 0):
            support[row["adapter"]] = {"adapter": row["adapter"], "variant": row["variant"],
                                       **row["step_check_carried"], "step_checks_off": row["step_checks_off"]}
    return list(support.values())


def run(args: Any) -> int:
    from zerogpu.launch import torch_unavailable_reason


    world = require_positive_int("world", _int("world", args.world))
    settings: dict[str, Any] = {
        "adapters": [a for a in args.adapters.split(",") if a],
        "variants": monitored_variants(args.variants),
        "steps": require_positive_int("steps", _int("steps", args.steps)),
        "warmup": _int("warmup", args.warmup),
        "rounds": require_positive_int("rounds", _int("rounds", args.rounds)),
        "width": require_positive_int("width", _int("width", args.width)),
        "depth": require_positive_int("depth", _int("depth", args.depth)),
        "batch": require_positive_int("batch", _int("batch", args.batch)),
        "device": require_device(args.device, present=True),
        "trace": bool(getattr(args, "trace", False)),
    }
    for adapter in settings["adapters"]:
        if adapter not in ADAPTERS:
            raise ConfigError("adapters", adapter, f"must be among {', '.join(ADAPTERS)}")
    skipped = unavailable_adapters(settings["adapters"])
    settings["adapters"] = [a for a in settings["adapters"] if a not in skipped]
    layout_world = _int("layout-world", args.layout_world)
    if layout_world < 0:
        raise ConfigError("layout-world", args.layout_world, "must be 0 (skip) or a number of ranks")
    digest_mb = _int("digest-mb", args.digest_mb)
    if digest_mb < 0:
        raise ConfigError("digest-mb", args.digest_mb, "must be 0 (skip) or a number of MB")
    reason = torch_unavailable_reason()
    if reason and settings["adapters"]:
        raise ConfigError("torch", "unavailable", reason)
    out = output_dir(args.out, "bench-monitor")
    started = time.monotonic()
    measured: dict[str, Any] = {"world_size": world, "rows": []}
    if settings["adapters"]:
        failed = _launch(world, settings, float(args.timeout), measured)
        if failed:
            return failed
    table = summarize(measured["rows"], settings["steps"])
    report = {"world_size": measured["world_size"], "settings": settings, "table": table,
              "step_checks": step_check_support(table),
              "skipped": [{"adapter": a, "reason": why} for a, why in skipped.items()],
              "rows": measured["rows"],
              "digest": digest_throughput(digest_mb, device=settings["device"]) if digest_mb else None,
              "collective": measured.get("collective"),
              "layout_check": layout_check_times(layout_world) if layout_world else None,
              "trace": measured.get("trace"),
              "wall_s": round(time.monotonic() - started, 1)}
    path = write_text(out / JSON_NAME, json.dumps(report, indent=2) + "\n")
    _print(report)
    print(f"wall time {report['wall_s']:.1f}s; wrote {path}")
    violations = sum(r["violations"] for r in table)
    if violations:
        print(f"error: {violations} violation(s) in fault-free runs")
        return 1
    trace = report["trace"]
    if trace is not None and trace["agree"] != trace["runs"]:
        print(f"error: the offline judge disagrees with the live run in {trace['runs'] - trace['agree']} "
              f"run(s) (each row's 'offline' in {path})")
        return 1
    return 0


def monitored_variants(text: Any) -> list[str]:
    """``--variants``: the comma-separated monitored variants to time (each among :data:`VARIANTS`, at
    least one), in :data:`VARIANTS`' order; the runs without the monitor come with them."""
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS or VARIANTS[name] is None:
            raise ConfigError("variants", name,
                              f"must be among {', '.join(v for v in VARIANTS if VARIANTS[v] is not None)}")
    if not names:
        raise ConfigError("variants", text, "must name at least one monitored variant")
    return [v for v in VARIANTS if v in names]


def unavailable_adapters(adapters: list[str]) -> dict[str, str]:
    """The optional adapters among ``adapters`` whose package is not installed here, with the reason
    (the install command): they are left out of the launch and reported as skipped."""
    from ..verify.adapters import missing_requirement

    return {a: why for a in adapters if a in OPTIONAL and (why := missing_requirement(a)) is not None}


def _launch(world: int, settings: dict[str, Any], timeout: float, measured: dict[str, Any]) -> int:
    """The torchrun launch of :mod:`zerosim.bench.monitor_rank`; fills ``measured``; 1 if it failed."""
    from zerogpu.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="zerosim-bench-monitor-") as tmp:
        result = Path(tmp) / "rows.json"
        traces = str(Path(tmp) / "traces") if settings["trace"] else None
        argv = ["-m", "zerosim.bench.monitor_rank",
                json.dumps({**settings, "result": str(result), "trace_dir": traces})]
        launch = run_ranks(world, argv, timeout, env={"PYTHONWARNINGS": "ignore"})
        if launch.returncode != 0 or not result.exists():
            tail = "\n".join((launch.stderr or "").strip().splitlines()[-15:])
            print(f"error: the benchmark launch ended with status {launch.returncode}"
                  f"{' (timed out)' if launch.timed_out else ''}:\n{tail}")
            return 1
        measured.update(json.loads(result.read_text()))
        if traces is not None:  # judged while the folders exist
            from .monitor_trace import compare

            measured["trace"] = compare(measured["rows"])
    return 0


def _print(report: dict[str, Any]) -> None:
    if report["table"]:
        print(f"{'adapter':<16} {'variant':<21} {'step ms':>8} {'ratio':>6} {'min-max':>11} {'accounted':>9} "
              f"{'projected':>9} {'checks':>6} {'ms/check':>8} {'+steps ms':>9} {'first ms':>8} "
              f"{'violations':>10}")
    for row in report["table"]:
        projected = row.get("projected")
        extra = row["all_check_ms"] - row["check_ms"] if row.get("all_check_ms") is not None else None
        print(f"{row['adapter']:<16} {row['variant']:<21} {row['step_ms']:>8.3f} {row['ratio']:>6.3f} "
              f"{row['ratio_min']:>5.3f}-{row['ratio_max']:<5.3f} {row['accounted']:>9.4f} "
              f"{'' if projected is None else f'{projected:.4f}':>9} "
              f"{row['checks']:>6} {row['check_ms']:>8.3f} "
              f"{'' if extra is None else f'{extra:.3f}':>9} "
              f"{row['first_check_ms']:>8.2f} {row['violations']:>10}")
    if report.get("step_checks"):
        print("step checks, ms per check (replay: a second forward and backward of the step's batch) and "
              "the timed checks that carried each:")
        for s in report["step_checks"]:
            ms = next(r["step_check_ms"] for r in report["table"]
                      if r["adapter"] == s["adapter"] and r["variant"] == s["variant"])
            carried = ", ".join(f"{kind} {ms[kind]:.3f} ms ({s[kind]}/{s['observed']})"
                                for kind in STEP_KINDS if kind != "fields")
            off = f"; off: {s['step_checks_off']}" if s["step_checks_off"] else ""
            print(f"  {s['adapter']:<16} {carried}, fields {ms['fields']:.3f} ms{off}")
    for row in report.get("skipped", ()):
        print(f"{row['adapter']:<16} skipped: {row['reason']}")
    trace = report.get("trace")
    if trace:
        print(f"offline (zerosim check trace's judge) on every monitored run's files: {trace['agree']} of "
              f"{trace['runs']} run(s) judged as live, {trace['checks_judged']} check(s), "
              f"{trace['violations']} violation(s)")
    if report.get("collective"):
        c = report["collective"]
        print(f"one all-gather of {c['row_numbers']} int64 per rank: median {c['median_s'] * 1e3:.3f} ms, "
              f"least {c['min_s'] * 1e3:.3f} ms")
    d = report["digest"]
    if d:
        print(f"on {report['settings']['device']}: digest {d['digest_gb_s']:.2f} GB/s vs copy "
              f"{d['copy_gb_s']:.2f} GB/s over {d['megabytes']} MB "
              f"(digest time / copy time {d['digest_over_copy']:.2f})")
    layout = report["layout_check"]
    if layout:
        print(f"C-ZERO-001 layout check, Llama-like {layout['parameters'] / 1e9:.1f}B parameters "
              f"({layout['tensors']} tensors) on {layout['world']} ranks:")
        for label, case in layout.items():
            if isinstance(case, dict):
                print(f"  {label}: {case['seconds']:.2f} s over {case['ranges']} ranges, "
                      f"{'PASS' if case['passed'] else 'FAIL'} ({case['layout']})"
                      + (f"; first: {case['violations'][0]}" if case["violations"] else ""))


def _int(field: str, text: Any) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ConfigError(field, text, "must be an integer") from None
