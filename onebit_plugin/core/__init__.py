"""The optimizer base (``base.OneBitOptimizer``), its policies and step exchanges, its stages,
momentum units, hand-off with the DDP hook, clipping, rank checks, checkpoints and memory
accounting.
"""
