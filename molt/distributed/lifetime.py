"""No process a Molt process starts outlives it. A torchrun rank (or `molt.eval`) starts its vLLM
engine core and its agent workers with multiprocessing's spawn; if the rank is killed with SIGKILL
(the OOM killer, a node agent) nothing in it runs to stop them, and an orphaned engine core keeps
its memory and its cores (on a GPU host, its GPU) until someone finds it.

Linux's parent-death signal ends them with their parent. It must be asked for in the child: spawn
re-imports the parent's main module (molt.train, molt.eval) as `__mp_main__` in every child before
the child's own code runs, and those modules call `die_with_owner` there. Agent workers ask for it
themselves (molt.rollout.agent_worker). vLLM's engine core stops its own workers when it exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

OWNER_PID_VARIABLE = "MOLT_OWNER_PID"  # the pid of the process whose spawned children die with it


def mark_owner() -> None:
    """Make this process the owner: what it spawns from here on dies with it (`die_with_owner`)."""
    os.environ[OWNER_PID_VARIABLE] = str(os.getpid())


def die_with_owner() -> None:
    """In a process the owner spawned: have the kernel SIGKILL it when the owner exits. Grandchildren
    (vLLM's workers under the engine core) are left to their own parent, unless the owner is already
    gone."""
    owner = os.environ.get(OWNER_PID_VARIABLE)
    if owner is None:
        return
    owner_pid = int(owner)
    if os.getppid() == owner_pid:
        exit_with_parent(owner_pid)
    elif not _alive(owner_pid):
        os._exit(1)


def exit_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits, however the parent exits (Linux; elsewhere a no-op).
    The request is tied to the parent's thread that started this process: start it from a thread that
    lives as long as the parent."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the pid over
        return False
    return True
