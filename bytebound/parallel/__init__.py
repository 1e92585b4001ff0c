"""Tensor / expert parallelism (issue 23): ``--tensor-parallel-size N`` runs N processes, one shard each.

* :mod:`bytebound.parallel.comm`: the process group (gloo on CPU, NCCL on CUDA), the launcher that starts the N
  processes itself (torchrun-compatible environment), and the rank-0-decides broadcasts of the engine.
* :mod:`bytebound.parallel.shard`: slices a loaded model in place (heads, experts, intermediate columns,
  vocabulary rows) and adds the per-layer all-reduces as forward hooks, so the layer code stays as it is.
"""

from bytebound.parallel.comm import TPGroup, current_group, init_from_env, launch
from bytebound.parallel.shard import shard_model

__all__ = ["TPGroup", "current_group", "init_from_env", "launch", "shard_model"]
