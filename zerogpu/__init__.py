"""zerogpu: the torch.distributed backend (NCCL on GPU, gloo on CPU), torch models and peer adapters."""
