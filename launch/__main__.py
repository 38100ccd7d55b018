"""`python -m shardserve.launch` runs the command line."""

from shardserve.launch.cli import main

main()
