"""The inference process: an OpenAI-compatible HTTP server over a generation engine (see `engines`)."""
