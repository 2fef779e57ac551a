"""The network: its config, the GPT, attention, Mamba-2 layers, hybrid conversion, the chunked runner,
weight fingerprints and quantised weights."""
