"""Pure readers of text a target controls: logs, metrics, stacks, redaction. Linear time, bounded, no I/O."""
