"""Tools on top of the library: bench, tune, demo, features, precompile, sass.

They import the library; the library never imports them (tests/test_layering.py checks it).
``python -m cute_fa <command>`` runs them (``cli.py``).
"""
