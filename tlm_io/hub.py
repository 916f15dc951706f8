"""Whether the model hub may be reached: the offline switches of the Hugging Face libraries, read in one place.

huggingface_hub honours ``HF_HUB_OFFLINE``; transformers also ``TRANSFORMERS_OFFLINE``, datasets also
``HF_DATASETS_OFFLINE``. A read that would go to the hub first asks :func:`offline` for the library it goes through,
so that it refuses in one line instead of waiting for a network timeout.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
SWITCHES = {"transformers": ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),  # models (snapshot_download)
            "datasets": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}  # text (datasets.load_dataset)


def offline(library: str) -> bool:
    """True when the user switched the hub off for ``library`` ("transformers" or "datasets")."""
    return any(os.environ.get(name, "").strip().lower() in TRUE for name in SWITCHES[library])


__all__ = ["SWITCHES", "offline"]
