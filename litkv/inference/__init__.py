"""Inference over a model and its caches: generate, KV blocks (segments), the conversation engine and
chat templates."""
