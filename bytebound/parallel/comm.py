"""The tensor-parallel process group and the engine's rank-0-decides broadcasts.

Every rank runs the same program (SPMD, as under ``torchrun``): the same prompts, the same forwards, each on its
shard. Rank 0 owns the choices - the request (prompt ids and sampling settings), every sampled token, the MTP
drafts and the accept decision, and when to stop - and broadcasts them, so the other ranks never decide anything
from their own copy of the logits (an all-reduce need not give every rank the same bits on every backend).

Environment (torchrun's names): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
:func:`launch` sets them and starts the N processes itself (``torch.multiprocessing`` spawn).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from bytebound.errors import ConfigError

_GROUP: "TPGroup | None" = None
# Followers wait in a broadcast between requests (a server may idle for hours): no collective timeout to trip.
_TIMEOUT = datetime.timedelta(days=7)


class TPGroup:
    """One rank's view of the tensor-parallel group (the default torch.distributed group).

    Args:
        rank, world: this process's rank and the group size N. device: where collectives run (CPU for gloo, this
            rank's GPU for NCCL); control tensors (tokens, flags) are made there.
    """

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.allreduces = 0          # all-reduces issued so far (the ledger counts them per step)
        self.closed = False          # a follower got rank 0's shutdown

    @property
    def lead(self) -> bool:
        return self.rank == 0

    # ---- collectives used by the sharded model ------------------------------------------------------------
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        self.allreduces += 1
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t [.., n]`` along the last dimension, rank order -> ``[.., N n]``."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, -1)

    # ---- rank 0 decides -------------------------------------------------------------------------------------
    def from_rank0(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's value of ``t`` (same shape and dtype on every rank) on every rank; returns a tensor on
        ``t``'s device."""
        x = t.detach().to(self.device).contiguous().clone()
        dist.broadcast(x, 0)
        return x.to(t.device)

    def sync_request(self, ids: list[int] | None, p) -> tuple[list[int], object] | None:
        """Rank 0 sends ``(ids, p)``; the other ranks get ``(ids, follower params)``, or None after
        :meth:`shutdown`. A follower's params carry rank 0's temperature / top-p / top-k and logprobs (the code
        paths match: a logprobs request decodes without MTP on every rank) but never stop on their own: rank 0's
        stop decision arrives through :meth:`lead_tokens`."""
        from bytebound.sampling import MAX_TOKENS_LIMIT, SamplingParams
        head = torch.zeros(3, dtype=torch.int64, device=self.device)      # prompt length, top_k, logprobs
        vals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.lead:
            head[0], head[1] = (-1, 0) if ids is None else (len(ids), int(p.top_k))
            head[2] = -1 if p is None or p.logprobs is None else p.logprobs
            if p is not None:
                vals[0], vals[1] = float(p.temperature), float(p.top_p)
        dist.broadcast(head, 0)
        n = int(head[0])
        if n < 0:
            self.closed = True
            return None
        dist.broadcast(vals, 0)
        t = (torch.tensor(ids, dtype=torch.int64, device=self.device) if self.lead
             else torch.zeros(n, dtype=torch.int64, device=self.device))
        dist.broadcast(t, 0)
        if self.lead:
            return ids, p
        temp, top_p = vals.tolist()
        return t.tolist(), SamplingParams(max_tokens=MAX_TOKENS_LIMIT, temperature=temp, top_p=top_p,
                                          top_k=int(head[1]), ignore_eos=True,
                                          logprobs=None if head[2] < 0 else int(head[2]))

    def shutdown(self) -> None:
        """Rank 0: tell followers waiting in :meth:`sync_request` (``Engine.follow``) to return."""
        if self.lead:
            self.sync_request(None, None)

    def _flag(self, value: int) -> int:
        f = torch.full((1,), value, dtype=torch.int64, device=self.device)
        dist.broadcast(f, 0)
        return int(f[0])

    def lead_tokens(self, source: Iterator) -> Iterator:
        """Rank 0's token source: after each item its consumer took, tell the followers to go on (1); when the
        consumer stops (closes the generator) tell them to stop (0)."""
        try:
            for item in source:
                yield item
                self._flag(1)
        finally:
            source.close()
            self._flag(0)

    def follow_tokens(self, source: Iterator) -> Iterator:
        """A follower's token source: the same items (their values broadcast from rank 0 inside ``source``),
        ending when rank 0's consumer stopped."""
        try:
            for item in source:
                yield item
                if not self._flag(0):
                    return
        finally:
            source.close()


def current_group() -> TPGroup | None:
    """The process's group once :func:`init_from_env` ran, else None."""
    return _GROUP


def init_from_env(device: str | torch.device = "cpu") -> TPGroup:
    """Join the group the environment describes (torchrun's variables) with gloo on CPU or NCCL on CUDA; once
    per process (a second call returns the same group).

    Raises:
        ConfigError: ``WORLD_SIZE`` / ``RANK`` missing or not integers.
    """
    global _GROUP
    if _GROUP is not None:
        return _GROUP
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise ConfigError("tensor parallelism needs RANK and WORLD_SIZE in the environment (start with "
                          f"--tensor-parallel-size N, or under torchrun): {type(e).__name__}: {e}") from None
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=_TIMEOUT)
    _GROUP = TPGroup(rank, world, dev)
    return _GROUP


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world: int, port: int, device: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    init_from_env(device)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, args: tuple = (), device: str = "cpu", grace_s: float = 10.0) -> None:
    """Run ``fn(rank, *args)`` in ``world`` fresh processes (spawn), each already in the group (gloo on CPU,
    NCCL on CUDA, one GPU per rank). Returns when all return. When one raises, the others are stopped and a
    ``torch.multiprocessing.ProcessRaisedException`` names it; when rank 0 returns and a follower is still
    waiting for it ``grace_s`` seconds later (rank 0 gave up on a request before telling the others, e.g. a
    refused prompt), the follower is stopped. ``fn`` must be importable (module level)."""
    import time
    import torch.multiprocessing as mp
    ctx = mp.start_processes(_worker, args=(fn, world, free_port(), device, args), nprocs=world, join=False,
                             start_method="spawn")
    lead_done = None
    while not ctx.join(timeout=0.2):
        if lead_done is None and not ctx.processes[0].is_alive() and ctx.processes[0].exitcode == 0:
            lead_done = time.monotonic()
        if lead_done is not None and time.monotonic() - lead_done > grace_s:
            for proc in ctx.processes[1:]:
                if proc.is_alive():
                    proc.terminate()
            for proc in ctx.processes[1:]:
                proc.join()
            return
