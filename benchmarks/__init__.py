"""Benchmarks: scripts that print a table and write JSON, side by side against a baseline in the
same run. Run each from the repository root as ``python -m benchmarks.<name>``; ``harness`` holds
what they share (servers started and stopped with their whole process tree, the load client)."""
