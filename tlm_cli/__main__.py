"""``python -m tlm_cli ...`` is the ``tlm`` command."""

from .launch import tlm_main

if __name__ == "__main__":
    tlm_main()
