"""The command line's processes let finished OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) unless told otherwise,
set before torch loads OpenMP."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = "import sys, os, tlm_cli; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"


def _probe(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    base["PYTHONPATH"] = str(ROOT) + os.pathsep + base.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return out.stdout.strip()


def test_the_cli_sets_a_passive_wait_before_torch_is_loaded_and_keeps_the_users_choice():
    assert _probe() == "PASSIVE False"  # set, and torch not yet imported: OpenMP reads it when torch loads it
    assert _probe(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE False"
