"""zerosim report: figures, JSON and index.md (see build.py)."""
