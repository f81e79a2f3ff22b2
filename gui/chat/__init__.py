"""The chat window: conversations with the coordinator's OpenAI-compatible API."""
