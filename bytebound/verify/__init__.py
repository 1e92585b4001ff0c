"""Start-up verification of every optimisation lever and the rolling accept-length watchdog (issue 7).

* :func:`build_manifest` (``manifest.py``): per lever, requested vs resolved, JSON-serialisable.
* :func:`run_canaries` (``canaries.py``): seconds-long checks on the loaded weights; ``strict`` raises.
* :class:`AcceptWatchdog` (``watchdog.py``): rolling accept length over the last N verify rounds.
* ``bytebound verify`` (``cli.py``).
"""

from bytebound.verify.canaries import CanaryResult, run_canaries
from bytebound.verify.manifest import build_manifest, format_manifest, print_manifest
from bytebound.verify.watchdog import AcceptLengthAlarm, AcceptWatchdog, watch_rounds

__all__ = ["AcceptLengthAlarm", "AcceptWatchdog", "CanaryResult", "build_manifest", "format_manifest",
           "print_manifest", "run_canaries", "watch_rounds"]
