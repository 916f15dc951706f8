"""tlm_cli: the ``tlm-convert`` command (tlm_cli.convert) and the ``tlm`` group (tlm_cli.main) over the Python API
of tlm_io, tlm_train and tlm_convert. The only package that prints.

OpenMP threads that finish a parallel op first sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, set here,
before torch loads OpenMP, unless the environment says otherwise): on a machine whose cores other jobs also use,
spinning threads keep the parked one they wait for off its core, and two threads ran 5-20x slower than one."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = []
