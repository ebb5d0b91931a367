"""Engine benchmarks: each module registers `radixmesh bench` subcommands (loadtests/commands.py lists them)."""
