"""The engine plugin's source tree, carried inside wedgectl's wheel as `wedgectl._engine`.

This file only makes the folder importable as data for wedgectl; the plugin itself is
the `wedge_engine` package below, installed into the server's environment from
pyproject.toml here.
"""
