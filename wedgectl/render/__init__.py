"""Verdicts and results as 80-column text or JSON. No I/O beyond what the caller prints."""
