"""Tensor-parallel workers are spawned processes, and a spawned process re-imports the script that started it: a
script that creates a tensor-parallel LLM at import time, without `if __name__ == "__main__":`, would start it
again in every worker. Python then stops each worker with a RuntimeError about its "bootstrapping phase", and the
parent sees workers die. These checks name the cause instead."""
import os
import sys

GUARD_ADVICE = ('spawned tensor-parallel workers re-import the script that starts them, so create the LLM under '
                '`if __name__ == "__main__":`')


def check_main_guard() -> None:
    """Refuse, before any worker exists, to start tensor parallelism from a script's top-level code when the
    script has no `__main__` guard at all (interactive sessions and notebooks re-import nothing: they pass)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # not under the main script's top-level code (a thread, an import hook): nothing to judge
        return
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            guarded = "__main__" in f.read()
    except OSError:
        return
    if not guarded:
        raise RuntimeError(f"{path} creates a tensor-parallel LLM at import time without a __main__ guard: "
                           f"{GUARD_ADVICE}")


def death_hint(started: bool) -> str:
    """What to add to the error about a worker that died: the likely cause when it died before starting up."""
    return "" if started else f"; a worker that exits before its start-up began is often this: {GUARD_ADVICE}"
