"""The ground floor: what every layer above uses and that imports nothing of litkv (checks of user input,
rotary embeddings)."""
