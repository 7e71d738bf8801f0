"""shardpar stages 0-3 against torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2, in one run.

    torchrun --standalone --nproc_per_node 2 tools/bench.py            # the default report
    python tools/bench.py --models mlp:tiny --rounds 2                  # world size 1, quick
    python tools/bench.py --device cuda --out /tmp/gpu.md               # one GPU: against plain torch
    torchrun --standalone --nproc_per_node 8 tools/bench.py --device cuda   # 8 GPUs, NCCL
    torchrun --standalone --nproc_per_node 4 tools/bench.py --configs stage3,stage3-g2,fsdp2,hsdp-g2
                                                                        # hybrid sharding (2 × 2) against HSDP
    OMP_NUM_THREADS=1 python tools/bench.py --models overhead --configs stage0,stage1,stage2,stage3,torch --rounds 25
    torchrun --standalone --nproc_per_node 2 tools/bench.py --models overhead --rounds 25
                                                # the host's share (#44): against plain torch, then the peers
                                                # (add --steps-per-round 1 for the median of 25 interleaved steps)
    torchrun --standalone --nproc_per_node 2 tools/bench.py --models nanochat:small \
        --configs distmuon,stage0,stage1,stage2,ddp     # Muon + AdamW (#43): against the DistMuon-style peer

The benchmark is the package beside this file, tools/benchkit/: its __init__.py says what
each module does and what is measured ([Note: what is measured], [Note: on CUDA]).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchkit, however this file is run

from benchkit.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
