"""Start-up verification of every optimisation lever and the rolling accept-length watchdog (issue 7).

* :func:`build_manifest` (``manifest.py``): per lever, requested vs resolved, JSON-serialisable.
* :func:`run_canaries` (``canaries.py``): seconds-long checks on the loaded weights; ``strict`` raises.
* :class:`AcceptWatchdog` (``watchdog.py``): rolling accept length over the last N verify rounds.
* ``bytebound verify`` (``cli.py``).
"""

from importlib import import_module

# Loaded on first use (PEP 562), so that importing ``bytebound.verify.cli`` to build the command line's parser
# does not import torch through the canaries and the manifest.
_WHERE = {"CanaryResult": "canaries", "run_canaries": "canaries", "build_manifest": "manifest",
          "format_manifest": "manifest", "print_manifest": "manifest", "AcceptLengthAlarm": "watchdog",
          "AcceptWatchdog": "watchdog", "watch_rounds": "watchdog"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
