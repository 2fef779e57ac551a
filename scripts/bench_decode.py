"""Greedy decoding: litkv (dense cache) vs Hugging Face transformers vs LitGPT, same random weights.

Usage: python scripts/bench_decode.py [--prompt_lengths '[512,2048,4096]'] [--max_new_tokens 128]
Same as `litkv bench`.
"""

from jsonargparse import CLI

from litkv.bench import bench

if __name__ == "__main__":
    CLI(bench, as_positional=False)
