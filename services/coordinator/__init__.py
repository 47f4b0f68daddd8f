"""The coordinator service."""
