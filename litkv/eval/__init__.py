"""Evaluation: perplexity and recall tasks, RULER, the bandwidth bound and the peer benchmarks."""
