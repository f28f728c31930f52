"""The evidence model: frozen data types, the error type, exit codes and numeric bounds. Imports nothing of wedgectl."""
