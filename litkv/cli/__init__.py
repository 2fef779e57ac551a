"""Command functions of the `litkv` CLI (`python -m litkv <command>`); library code lives elsewhere."""
