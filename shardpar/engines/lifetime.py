"""What the engines need of the interpreter's exit."""

from __future__ import annotations

import atexit
import gc


def collect_cycles_before_exit() -> None:
    """[Note: collecting at exit] A wrapped model is a reference cycle (its modules' hooks
    hold the engine, which holds the modules), so a script that drops it leaves it to the
    cycle collector, with the process group the engine holds. Left to the interpreter's
    finalisation, the group would be destroyed after torch's own state, which can abort the
    process ("terminate called without an active exception") after a run that succeeded.
    Collecting at exit, while everything is alive, frees them in a healthy state; see also
    [Note: no group outlives destroy_process_group] in comm/process_group.py."""
    gc.collect()


atexit.register(collect_cycles_before_exit)
