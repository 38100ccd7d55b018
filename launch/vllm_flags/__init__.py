"""vLLM's `vllm serve` flags on `shardserve launch` and `plan`: each one ours under the same name, renamed to
ours, accepted with a notice (it changes nothing here) or refused saying what to use (table.py); argv.py
rewrites a command line before click reads it."""
