"""Cost models: closed-form per-rank memory (memory_model) and communication (comm_model)."""
