"""`litkv serve`: an OpenAI-compatible chat server on LitServe that keeps each conversation's cache state."""

from litkv.serve.engine import Engine, RequestError, TurnRequest, TurnResult
from litkv.serve.store import ConversationStore

__all__ = ["Engine", "RequestError", "ConversationStore", "TurnRequest", "TurnResult"]
