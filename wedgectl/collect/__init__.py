"""Collectors: the only code that reads /proc, HTTP and py-spy; each returns data plus what failed."""
