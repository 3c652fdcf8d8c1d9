"""The gateway: OpenAI HTTP API over a token source (an in-process engine or a P/D cluster)."""
