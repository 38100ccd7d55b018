"""Many machines: the Ray cluster (`shardserve cluster`), its nodes and ports, the facts each node must share, waiting for a cluster's GPUs, and `shardserve doctor` with its GPU and NCCL checks."""
