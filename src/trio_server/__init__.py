"""TRIO's service: the core (sessions, ordered queues, futures, store, checkpoints) and
the FastAPI app behind ``trio serve``."""
