"""Ways in beside the optimizers: the DDP comm hook, the standalone 1-bit allreduce, DeepSpeed
configs, the lockstep check and DCP checkpoints of sharded models.
"""
