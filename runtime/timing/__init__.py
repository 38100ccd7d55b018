"""The runtime timing itself for `shardserve calibrate`: operators, the all-reduce, the host's work per step."""
