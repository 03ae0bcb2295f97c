"""The reference numerics (layer 0): the array-namespace seam (``xp``), flat views, the block
model, the reference optimizers, mixed precision and the unsharded ground truth.
"""
