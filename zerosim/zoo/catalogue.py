"""The zoo's catalogue: silent-correctness bugs from public reports, each with what should catch it.

One :class:`Entry` per report: where it comes from, the regime it needs, its mechanism in one sentence,
the verify run of its bug trainer and fixed twin (:mod:`zerosim.zoo.bugs`), the monitored loop of the
same mechanism (:mod:`zerosim.zoo.live`) where the bug can happen inside a live run, and the outcome
each judge is expected to give: ``catch`` (the bug fails the judge), ``finding`` (verify passes the
values and reports the traffic or memory off the declared strategy), ``miss`` (a known miss: ``gap``
names the check that would see it and why it does not today). A judge with no plan is out of reach,
with the reason. Every fixed twin is expected to pass both judges (no false alarm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CATCH, FINDING, MISS = "catch", "finding", "miss"
OUTCOMES = (CATCH, FINDING, MISS)

#: the optimizer steps of every zoo verify run (2 SGD, 2 AdamW with a binding clip) and its world size
VERIFY_STEPS, WORLD = 4, 2


@dataclass(frozen=True)
class VerifyPlan:
    """``zerosim verify zerosim.zoo.bugs:{broken,fixed}_<mechanism>`` with ``options`` (verify's keywords)."""

    mechanism: str
    options: dict[str, Any] = field(default_factory=dict)
    expect: str = CATCH


@dataclass(frozen=True)
class LivePlan:
    """The monitored loop of :mod:`zerosim.zoo.live` running ``mechanism`` (and its twin)."""

    mechanism: str
    expect: str = CATCH


@dataclass(frozen=True)
class Entry:
    """One reported bug. ``verify`` / ``live``: None when out of reach, ``verify_reason`` /
    ``live_reason`` saying why; ``gap``: for an expected miss, the check that would see it."""

    id: str
    report: str
    framework: str
    regime: str
    mechanism: str
    verify: VerifyPlan | None
    live: LivePlan | None
    verify_reason: str = ""
    live_reason: str = ""
    gap: str = ""
    source_note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "report": self.report, "framework": self.framework, "regime": self.regime,
                "mechanism": self.mechanism,
                "verify": None if self.verify is None else {"mechanism": self.verify.mechanism,
                                                            "options": dict(self.verify.options),
                                                            "expect": self.verify.expect},
                "live": None if self.live is None else {"mechanism": self.live.mechanism,
                                                        "expect": self.live.expect},
                "verify_reason": self.verify_reason, "live_reason": self.live_reason, "gap": self.gap,
                "source_note": self.source_note}


_ACCUM = {"grad_accum": 2}
_RESUME_OTHER_WORLD = {"resume_at": 1, "resume_world": 3}
_MOE = {"model": "moe"}
_SAME_WRONG_TOKEN_GRADIENT = (
    "the token gradient is wrong inside each rank's backward, before any reduction, and the same code "
    "computes it again on replay: the local gradients grad_accounting averages and the replayed ones "
    "carry the same omission, every rank ends with the same averaged gradient, so only a recompute of "
    "the layer without the exchange (verify's unsharded reference) would see it")
_CHECKPOINT_ONLY = "a checkpoint save or load: no live run holds both sides of it"
_LOSS_DIVISOR = ("the loss is divided by the wrong count before backward, so the local gradients the "
                 "monitor's grad_accounting projects carry the same factor as the consumed one: only a check "
                 "that knows the loop's micro-batch count and its loss divisor (verify's reference does) "
                 "would see it")
_OUTSIDE_THE_STEP = ("the rounding happens after optimizer.step(), outside the pre/post hooks the update "
                     "check reads, identically on every rank: a check that the parameters and state the "
                     "next step starts from are the ones the last step left would see it")

ENTRIES: tuple[Entry, ...] = (
    Entry("open-instruct-1498", "open-instruct PR #1498", "DeepSpeed ZeRO-2 (via open-instruct)",
          "ZeRO-2, manual accumulation of 2 micro-batches, fp32",
          "With gradient_accumulation_steps=1 in the config every backward is a boundary, and a boundary "
          "resets ZeRO-2's accumulator, so only the last micro-batch's gradient reaches the step.",
          VerifyPlan("last_micro_batch_only", _ACCUM), LivePlan("last_micro_batch_only")),
    Entry("deepspeed-6550", "DeepSpeed PR #6550", "DeepSpeed", "accumulation of 2 micro-batches",
          "The micro-batch losses are not divided by the accumulation count, so the step uses K times the "
          "mean gradient.",
          VerifyPlan("unscaled_accumulation", _ACCUM), LivePlan("unscaled_accumulation", MISS),
          gap=_LOSS_DIVISOR,
          source_note="the thread was not found in the searchable corpus; the mechanism is the accumulation "
                      "scaling class the report is listed under, reproduced as such"),
    Entry("accelerate-3877", "accelerate #3877", "accelerate + DeepSpeed ZeRO-2",
          "ZeRO-2, accumulation of 2 micro-batches",
          "Training with accumulation under ZeRO-2 gives a different (worse) loss than without; reproduced "
          "as the loss divided by the accumulation count twice (by the loop and again by the engine).",
          VerifyPlan("double_scaled_accumulation", _ACCUM), LivePlan("double_scaled_accumulation", MISS),
          gap=_LOSS_DIVISOR,
          source_note="the thread reports the symptom without a root cause; the double division is the "
                      "accelerate/DeepSpeed interplay transformers PR #35808 describes"),
    Entry("deepspeed-8443", "DeepSpeed #8443", "DeepSpeed ZeRO-3",
          "ZeRO-3, Muon, accumulation of 2 micro-batches (modelled on replicated parameters)",
          "ZeRO-3 applies Muon's Newton-Schulz once per micro-batch inside the gradient reduce, so momentum "
          "advances K times per step on partial gradients.",
          VerifyPlan("muon_per_micro_batch", {"optimizers": "muon", "grad_accum": 2}),
          LivePlan("muon_per_micro_batch")),
    Entry("pytorch-170862", "pytorch #170862", "PyTorch FSDP2", "FSDP2, clip_grad_norm_",
          "clip_grad_norm_ on FSDP2's sharded gradients returns the norm of this rank's shard and clips by "
          "it, not by the norm over every parameter.",
          VerifyPlan("local_clip_norm"), LivePlan("local_clip_norm")),
    Entry("deepspeed-7718", "DeepSpeed #7718", "DeepSpeed ZeRO", "ZeRO, logged gradient norm",
          "The logged gradient norm is too low by the number of shards (the averaging divisor applied to the "
          "norm once more); the clip itself is right.",
          VerifyPlan("logged_norm_over_shards"), LivePlan("logged_norm_over_shards"),
          source_note="the thread was not found in the searchable corpus; the mechanism is the one the "
                      "report is listed under (a logged norm too low by the shard count)"),
    Entry("miles-diffusion-35", "radixark/miles_diffusion PR #35", "miles (FSDP)", "sharded, logged norm",
          "The ranks' squared norms are averaged rather than summed before the root, so the logged norm is "
          "too low by the root of the shard count.",
          VerifyPlan("logged_norm_squares_averaged"), LivePlan("logged_norm_squares_averaged"),
          source_note="the thread was not found in the searchable corpus; reproduced from the summary "
                      "(logged norm too low by the shard count), as the averaged-squares variant"),
    Entry("megatron-5916", "Megatron-LM PR #5916", "Megatron-LM", "EP x TP, clipping (dense stand-in)",
          "With EP > 1 and TP > 1 the gradient norm leaves some experts out, so clipping applies less than "
          "it should and the logged norm is low.",
          VerifyPlan("experts_out_of_norm"), LivePlan("experts_out_of_norm")),
    Entry("megatron-5956", "Megatron-LM PR #5956", "Megatron-FSDP v2", "EP, FSDP (dense stand-in)",
          "Expert gradients already sum over the expert-parallel ranks' tokens, and the reduce averages over "
          "the expert-data-parallel mesh only: they come out ep_size times too large.",
          VerifyPlan("expert_gradients_summed"), LivePlan("expert_gradients_summed")),
    Entry("pytorch-160285", "pytorch #160285", "torchtitan-style EP MoE", "expert parallel 2, MoE",
          "With EP=2 every expert gradient is exactly twice its size; the loss curves look the same.",
          VerifyPlan("expert_divide_factor_skipped", _MOE), LivePlan("expert_divide_factor_skipped"),
          source_note="the thread reports the symptom without a root cause; pytorch PR #167178 reports it "
                      "in the same configuration (torchtitan, EP degree equal to the world size: expert "
                      "gradients world-size times too large) with its cause, reproduced here: the "
                      "all-to-all's backward sums every rank's tokens into the expert gradient, and "
                      "fully_shard skips its gradient divide factor on an expert-data-parallel group of "
                      "one rank"),
    Entry("transformers-48687", "transformers #48687", "transformers EP (batched_mm)",
          "expert parallel, router (dense stand-in)",
          "Under expert parallelism the router receives the wrong gradient (only this rank's experts' part, "
          "not reduced); the loss is right, so nothing in the run looks off.",
          VerifyPlan("router_not_reduced"), LivePlan("router_not_reduced")),
    Entry("nemo-automodel-1260", "NeMo Automodel PR #1260", "NeMo Automodel GroupedExperts", "EP, MoE",
          "The input all-gather across EP ranks has no reduce-scatter in its backward, so each token's "
          "gradient misses the other ranks' experts' contributions.",
          VerifyPlan("token_gather_without_reduce_scatter", _MOE),
          LivePlan("token_gather_without_reduce_scatter", MISS), gap=_SAME_WRONG_TOKEN_GRADIENT),
    Entry("rocm-megatron-63", "ROCm/Megatron-LM PR #63", "Megatron-LM (ROCm)", "resume at another world size",
          "A fused SwiGLU projection saved in its per-rank [gate; up] layout is read back with the new rank "
          "count, so at another GPU count its chunks land in the wrong rows.",
          VerifyPlan("fused_chunks_reordered", _RESUME_OTHER_WORLD), None, live_reason=_CHECKPOINT_ONLY,
          source_note="the thread was not found in the searchable corpus; the chunk order it names is the "
                      "one of Megatron-LM #360 (gate and up split per tensor-parallel rank)"),
    Entry("megatron-6024", "Megatron-LM PR #6024", "Megatron-FSDP v2 + DCP", "resume",
          "A plain DCP save of parameters packed into one padded flat buffer computes global offsets as if "
          "each shard tiled evenly, and silently corrupts the checkpoint.",
          VerifyPlan("canonical_shard_offsets", {"resume_at": 1}), None, live_reason=_CHECKPOINT_ONLY),
    Entry("deepspeed-6691", "DeepSpeed #6691", "DeepSpeed universal checkpoint",
          "resume at another world size",
          "Training resumed from a converted universal checkpoint behaves as if the model were initialised "
          "from scratch.",
          VerifyPlan("resumes_from_scratch", _RESUME_OTHER_WORLD), None, live_reason=_CHECKPOINT_ONLY),
    Entry("deepspeed-7606", "DeepSpeed #7606", "DeepSpeed ZeRO++ (hpZ)", "ZeRO-3 + hpZ, resume",
          "After a checkpoint load the hpZ secondary copy is stale, so the first step after it runs on the "
          "weights from before the load and its loss jumps.",
          VerifyPlan("stale_secondary_after_load", {"resume_at": 1}), None, live_reason=_CHECKPOINT_ONLY),
    Entry("verl-7834", "verl #7834", "verl FSDP2", "FSDP2 meta init, tied embeddings",
          "to_empty() gives every parameter fresh storage, so the tied head stops aliasing the embedding, "
          "which then gets only its input-side gradient.",
          VerifyPlan("untied_embedding", {"model": "gpt-tied"}), None,
          live_reason="a setup-time bug: the monitor judges the model it is given, and an untied copy is "
                      "consistent on every rank"),
    Entry("megatron-4609", "Megatron-LM PR #4609", "Megatron-LM layer-wise optimizer",
          "overlapped param all-gather",
          "The all-gather reuses the gradient buffer as its receive buffer and does not zero it, so every "
          "later gradient is accumulated on top of the gathered parameters.",
          VerifyPlan("stale_gather_in_grad_buffer"), LivePlan("stale_gather_in_grad_buffer")),
    Entry("megatron-950", "Megatron-LM #950", "Megatron-LM distributed optimizer",
          "--overlap-param-gather, mcore models",
          "When the buffer's order differs from the forward's, a parameter's bucket has not been gathered "
          "when the forward reads it: it computes with the previous step's weights.",
          VerifyPlan("forward_on_previous_weights"), LivePlan("forward_on_previous_weights")),
    Entry("pytorch-194628", "pytorch PR #194628", "PyTorch FSDP2 HSDP",
          "HSDP, deferred all-reduce, accumulation, bf16 reduce dtype",
          "With the all-reduce deferred the microbatches' partial sums are held at the reduce dtype, so each "
          "contribution is rounded into the buffer and the error grows with the microbatch count.",
          VerifyPlan("partial_sums_in_reduce_dtype", _ACCUM), LivePlan("partial_sums_in_reduce_dtype")),
    Entry("deepspeed-5170", "DeepSpeed PR #5170", "DeepSpeed ZeRO-0 + BF16_Optimizer", "bf16",
          "The engine all-reduces the bf16 gradients although BF16_Optimizer accumulates them in an fp32 "
          "buffer: the reduction happens in the narrow dtype.",
          VerifyPlan("reduces_in_narrow_dtype"), LivePlan("reduces_in_narrow_dtype")),
    Entry("torchtune-2254", "torchtune #2254", "torchtune FSDP2", "bf16 end to end",
          "Training fully in bf16 converges far worse than fp32; the report points at weights and optimizer "
          "state kept in bf16 (no fp32 master), reproduced as bf16 weights.",
          VerifyPlan("weights_in_narrow_dtype"), LivePlan("weights_in_narrow_dtype", MISS),
          gap=_OUTSIDE_THE_STEP),
    Entry("opentau-181", "OpenTau #181", "OpenTau (DDP, accelerate)", "bf16 parameters, AdamW",
          "The inner AdamW was built over the bf16 parameters, so its exp_avg and exp_avg_sq are bf16.",
          VerifyPlan("optimizer_state_in_narrow_dtype"), LivePlan("optimizer_state_in_narrow_dtype", MISS),
          gap=_OUTSIDE_THE_STEP,
          source_note="the thread #181 was not found; OpenTau #184 describes the state: bf16 exp_avg / "
                      "exp_avg_sq before the fp32-master change"),
    Entry("pytorch-154888", "pytorch #154888", "PyTorch FSDP1 HYBRID_SHARD", "HSDP on a (2, 1) mesh",
          "On an (n, 1) mesh the shard group is one rank and the cross-replica all-reduce is dropped: every "
          "replica trains on its own data.",
          VerifyPlan("replicas_not_reduced", {"mesh": (2, 1)}), LivePlan("replicas_not_reduced")),
    Entry("cosmos-161", "NVIDIA/cosmos-framework #161", "cosmos-framework FSDP2", "HSDP, accumulation 2",
          "ddp_sync_grad only knows DDP, so under FSDP2 it does nothing and every micro-step runs the full "
          "gradient reduction: right numbers, K times the traffic.",
          VerifyPlan("reduces_every_micro_batch", _ACCUM, FINDING), None,
          live_reason="right numbers: the monitor judges values, not traffic"),
    Entry("bloom-176b", "BLOOM-176B training (bigscience Megatron-DeepSpeed PRs #270, #271)",
          "Megatron-DeepSpeed", "bf16, tensor-parallel replicated layer norms",
          "Layer-norm weights replicated across tensor-parallel ranks received gradients that differ in the "
          "last bits and were never re-synchronised, so the replicas drifted apart.",
          VerifyPlan("layer_norm_replica_drift", {"mesh": (2, 1)}), LivePlan("layer_norm_replica_drift")),
    Entry("sdc-weight-bitflip", "silent data corruption (a flipped bit in one rank's weights)", "any",
          "data parallel, replicated weights",
          "One bit of one rank's copy of a weight flips in memory; that rank goes on training on it.",
          VerifyPlan("weight_bit_flip"), LivePlan("weight_bit_flip")),
    Entry("sdc-gradient-bitflip", "silent data corruption (a flipped bit in one rank's gradient)", "any",
          "data parallel, before the all-reduce",
          "One bit of one rank's local gradient flips before the all-reduce, which hands the same wrong "
          "value to every rank.",
          VerifyPlan("gradient_bit_flip"), LivePlan("gradient_bit_flip")),
)

BY_ID = {e.id: e for e in ENTRIES}
