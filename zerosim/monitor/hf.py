"""``ZeroMonitorCallback``: the monitor in a Hugging Face ``transformers`` ``Trainer`` run, one line away::

    trainer = Trainer(model, args, train_dataset=data, callbacks=[ZeroMonitorCallback(every=100, out="mon")])

The callback builds its :class:`~zerosim.monitor.Monitor` when training begins, from the model and the
optimizer the Trainer hands its callbacks (DDP and FSDP runs: the module and its torch.optim optimizer;
DeepSpeed runs: the ZeRO optimizer DeepSpeed put in the Trainer, read with
:func:`zerosim.monitor.deepspeed_layout.deepspeed_layout`), checks at the end of every ``every``-th optimizer
step (``state.global_step - 1``, 0-based as the monitor counts; the Trainer hands callbacks no gradient
norm, so that clause compares none) and writes the summary when training ends (``callback.summary``).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .monitor import Monitor


class _ZeroOptimizerEngine:
    """What :func:`~zerosim.monitor.deepspeed_layout.deepspeed_layout` reads of an engine, from the module and
    the ZeRO optimizer alone (the Trainer hands its callbacks those, not the engine)."""

    def __init__(self, module: Any, optimizer: Any):
        self.module = module
        self.optimizer = optimizer

    def zero_optimization_stage(self) -> int:
        if hasattr(self.optimizer, "fp32_partitioned_groups_flat"):
            return 3
        return 2 if getattr(self.optimizer, "partition_gradients", False) else 1


class ZeroMonitorCallback(TrainerCallback):
    """See the module docstring; ``options`` go to the Monitor (``on_violation``, ``max_norm``, ``log``);
    ``max_grad_norm`` defaults to the Trainer's own (``TrainingArguments.max_grad_norm``)."""

    def __init__(self, every: Any = 100, out: Any = None, **options: Any):
        self.every = every
        self.out = out
        self.options = options
        self.monitor: Monitor | None = None
        self.summary: dict[str, Any] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", None)  # transformers/accelerate wrap the optimizer
        clip = getattr(args, "max_grad_norm", None)  # the Trainer clips at it when it is above 0
        if "max_grad_norm" not in self.options and isinstance(clip, int | float) and clip > 0:
            self.options = {**self.options, "max_grad_norm": float(clip)}
        if inner is not None and (hasattr(inner, "single_partition_of_fp32_groups")
                                  or hasattr(inner, "fp32_partitioned_groups_flat")):
            from .deepspeed_layout import deepspeed_layout

            engine = _ZeroOptimizerEngine(model, inner)
            self.monitor = Monitor(model, inner, every=self.every, out=self.out,
                                   layout_reader=lambda: deepspeed_layout(engine), **self.options)
            return
        self.monitor = Monitor(model, inner if inner is not None else optimizer, every=self.every,
                               out=self.out, **self.options)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.after_step(state.global_step - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.summary = self.monitor.close()
