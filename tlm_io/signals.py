"""Signal handlers that stay with the process that installed them.

A command's one-line-stop handlers are inherited by every process it forks, such as a library's worker pool
(lm-evaluation-harness bootstraps its stderr in a ``multiprocessing`` pool). There, SIGTERM comes from the pool's
``terminate()`` and must end the worker; a handler that raises instead can leave the worker alive and the command
waiting on it forever. (A training run's handler, which only sets a flag, stays inherited on purpose: its DataLoader
workers must outlive a Ctrl-C to the group while the run steps on to its checkpoint.)
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
