"""`python -m wedgectl` runs the CLI."""

from wedgectl.cli import main

main()
