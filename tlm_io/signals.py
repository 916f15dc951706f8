"""Signal handlers that stay with the process that installed them.

A command's handlers (a one-line stop, a checkpoint at the next step) are inherited by every process it forks: a
library's worker pool (lm-evaluation-harness bootstraps its stderr in a ``multiprocessing`` pool), a DataLoader
worker. There, SIGTERM comes from the pool's ``terminate()`` and must end the worker; a handler that raises or sets a
flag instead leaves the worker alive and the command waiting on it forever.
"""

from __future__ import annotations

import os
import signal


def default_in_forked_child(owner_pid: int, signum: int) -> bool:
    """In a process other than ``owner_pid`` (a forked child): give ``signum`` its default action and send it again
    (the child ends as its parent expects), and return True; in the owner, return False."""
    if os.getpid() == owner_pid:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


__all__ = ["default_in_forked_child"]
