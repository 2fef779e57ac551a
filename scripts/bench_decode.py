"""Greedy decoding: litkv (eager and compiled) vs Hugging Face transformers (dynamic cache, and static
cache + torch.compile) vs LitGPT, same random weights, each row against the memory-bandwidth bound.

Usage: python scripts/bench_decode.py [--prompt_lengths '[512,2048,4096]'] [--max_new_tokens 128]
    [--peers '[litkv, litkv-compile, hf, hf-static-compile, litgpt]'] [--threads 1] [--quick true]
Same as `litkv bench`.
"""

from jsonargparse import CLI

from litkv.bench import bench

if __name__ == "__main__":
    CLI(bench, as_positional=False)
