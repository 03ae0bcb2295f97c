"""zerogpu: the torch.distributed backend (NCCL on GPU, gloo on CPU) of the zerosim engine and contracts.

- :mod:`zerogpu.comm`: the TorchCommunicator (the engine's collectives, timeouts, traffic accounting).
- :mod:`zerogpu.simulate`, :mod:`zerogpu.equivalence`, :mod:`zerogpu.selftest`: what runs on each
  torchrun rank (``torchrun --nproc-per-node N -m zerogpu <command>``); :mod:`zerogpu.rank`: the
  failure policy every rank follows; :mod:`zerogpu.program`: the per-rank program on the device.
- :mod:`zerogpu.launch`: starting torchrun (``zerosim simulate --backend torch``);
  :mod:`zerogpu.gpu_report`: ``python -m zerogpu report`` (JSON + markdown, needs CUDA or ``--cpu``).
- :mod:`zerogpu.agreement`: how closely a torchrun run matches the in-process simulator.
"""
