"""``python -m tlm_convert ...`` is the ``tlm-convert`` command (tlm_cli.launch: its sizes check, then tlm_cli.convert). An entry point, not a module of
the package: it imports the CLI floor above it, which tests/test_imports.py allows for ``__main__`` modules only."""

from tlm_cli.launch import convert_main

if __name__ == "__main__":
    convert_main()
