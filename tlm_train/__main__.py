"""``python -m tlm_train ...`` is the ``tlm`` command (tlm_cli.launch, then tlm_cli.main), handy under ``torchrun -m tlm_train train
RECIPE``. An entry point, not a module of the package: it imports the CLI floor above it, which
tests/test_imports.py allows for ``__main__`` modules only."""

from tlm_cli.launch import tlm_main

if __name__ == "__main__":
    tlm_main()
