"""Evidence at rest: bundles written and read back (bounded, hostile-safe) and the log/bundle sources of a diagnosis."""
