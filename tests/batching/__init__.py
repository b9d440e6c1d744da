"""Continuous batching: the engine and `kvports batch` (test_batching.py), and what the server
asks of the engine (test_engine.py)."""
