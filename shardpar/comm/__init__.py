"""Layer 1: the collectives, the only code of shardpar that calls ``torch.distributed``."""
