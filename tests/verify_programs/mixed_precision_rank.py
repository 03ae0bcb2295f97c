"""Rank program for tests/test_verify_mixed_precision.py: each named built-in adapter trains the
built-in GPT (float32, the master dtype) for two steps in full precision and under bf16, five under fp16,
with traffic counted; rank 0 stores what each run showed (zerosim.files.datafile).

Per (adapter, precision): whether the masters before the first step are the float32 model the
factory received (bitwise), the dtype the model's head computed in, the dtypes of the gradient
reductions and parameter gathers in the traffic records, the dtypes ``full_parameters()`` and
``full_optimizer_state()`` returned, how many master elements are not bfloat16-representable (a
trainer that keeps no float32 master has none), the loss scale, and a save/load round trip:
whether a fresh trainer that loads the checkpoint returns the same masters and loss scale (mixed
precision only), and under bf16 whether two half micro-batches accumulate to exactly one step.
``unsupported``: the NotImplementedError's reason, where the adapter refuses the policy.

Run under run_ranks: ``mixed_precision_rank.py OUT_FILE CHECKPOINT_DIR ADAPTER[,ADAPTER...]``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerosim.files import datafile
from zerosim.verify.model import build_model, micro_batch
from zerosim.verify.protocol import close_trainer
from zerosim.verify.suite import PHASE_CONFIGS
from zerosim.verify.targets import resolve_factory
from zerosim.verify.traffic import TrafficCounter

POLICIES: dict[str, dict[str, Any] | None] = {
    "full": None,
    "bf16": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    "fp16": {"param_dtype": "float16", "reduce_dtype": "float32",
             "loss_scale": {"init": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 1000}},
}
#: steps per precision: float16's first steps overflow at the protocol's initial scale 65536 on this
#: model and are skipped (the scale backs off to 8192 by the fourth), so it runs until one is taken
STEPS = {"full": 2, "bf16": 2, "fp16": 5}


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def build(name: str, precision: str) -> tuple[Any, list[str]]:
    """(trainer or the refusal's reason, the head's output dtypes recorded by a forward hook)."""
    optim = dict(PHASE_CONFIGS["adamw"])
    optim["max_grad_norm"] = 0.05
    if POLICIES[precision] is not None:
        optim["mixed_precision"] = POLICIES[precision]
    model = build_model("gpt", "float32", 0)
    seen: list[str] = []
    model.head.register_forward_hook(lambda _m, _i, out: seen.append(_name(out.dtype)))
    try:
        return resolve_factory(name)(model, optim), seen
    except NotImplementedError as e:
        return str(e), seen


def run(name: str, precision: str, checkpoint: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    trainer, seen = build(name, precision)
    if isinstance(trainer, str):
        return {"unsupported": trainer}
    arrived = {n: p.detach() for n, p in build_model("gpt", "float32", 0).named_parameters()}
    start = trainer.full_parameters()
    starts_from_model = all(torch.equal(start[n].float(), arrived[n]) for n in arrived)
    with TrafficCounter() as counter:
        for step in range(1, STEPS[precision] + 1):
            trainer.step(*micro_batch(rank, step, 0))
    params = trainer.full_parameters()
    state = trainer.full_optimizer_state()
    scale = getattr(trainer, "loss_scale", None)
    out: dict[str, Any] = {
        "compute": sorted(set(seen)),
        "reduce": sorted({c.dtype for c in counter.calls if c.traffic_class == "reduce"}),
        "gather": sorted({c.dtype for c in counter.calls if c.traffic_class == "gather"}),
        "params": sorted({_name(p.dtype) for p in params.values()}),
        "state": sorted({_name(v.dtype) for s in state.values() for k, v in s.items() if k != "step"}),
        "not_bf16": int(sum(int((p.float() != p.to(torch.bfloat16).float()).sum()) for p in params.values())),
        "numel": int(sum(p.numel() for p in params.values())),
        "starts_from_model": starts_from_model,
        "norm": float(trainer.last_grad_norm()),
        "scale": None if scale is None else scale.state_dict(),
    }
    if precision == "full":  # full precision's checkpoints are covered by the resume tests
        close_trainer(trainer)
        return out
    directory = checkpoint / f"{name}-{precision}"
    trainer.save_checkpoint(str(directory))
    close_trainer(trainer)
    fresh, _ = build(name, precision)
    assert not isinstance(fresh, str)
    fresh.load_checkpoint(str(directory))
    loaded = fresh.full_parameters()
    out["resumed_bitwise"] = all(torch.equal(loaded[n], params[n]) for n in params)
    fresh_scale = getattr(fresh, "loss_scale", None)
    out["resumed_scale"] = None if fresh_scale is None else fresh_scale.state_dict()
    close_trainer(fresh)
    return out


def accumulation_round_trip(name: str, precision: str) -> bool:
    """Whether ``step_accumulated([b, b])`` leaves the same masters as ``step(b)`` bitwise: the two
    halves of each gradient add up exactly in float32 (and in 16 bits), so any difference is the
    accumulation path losing or double-counting a micro-batch."""
    rank = dist.get_rank()
    batch = micro_batch(rank, 1, 0)
    single, _ = build(name, precision)
    single.step(*batch)
    expected = single.full_parameters()
    close_trainer(single)
    accumulated, _ = build(name, precision)
    accumulated.step_accumulated([batch, batch])
    got = accumulated.full_parameters()
    close_trainer(accumulated)
    return all(torch.equal(got[n], expected[n]) for n in expected)


def main() -> None:
    out, checkpoint, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in names:
        for precision in POLICIES:
            print(f"rank {dist.get_rank()}: {name}/{precision}", file=sys.stderr, flush=True)
            local = run(name, precision, checkpoint)
            if precision == "bf16" and "unsupported" not in local:
                local["accumulation_bitwise"] = accumulation_round_trip(name, precision)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            results[f"{name}/{precision}"] = gathered
    if dist.get_rank() == 0:
        datafile.save(out, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from zerogpu.rank import leave_rank

    main()
    leave_rank(0)
