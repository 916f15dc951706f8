"""``python -m tlm_train ...`` is the ``tlm`` command (handy under ``torchrun -m tlm_train train RECIPE``)."""

from .cli import tlm_main

if __name__ == "__main__":
    tlm_main()
