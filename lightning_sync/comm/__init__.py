"""Plain torch.distributed algorithms (no Lightning): the meter, compression, bucketing, averaging, consistency."""
