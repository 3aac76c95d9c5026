"""Where each rank of a multi-rank stage runs, and which of them went quiet when something failed.

A multi-node job that loses a node should end naming it, not hang or blame the node that
noticed. Three parts:

- `node_line`: each node's first rank logs, before it joins the process group, its hostname,
  address, node rank, local ranks and the rendezvous (so a node that cannot join still says
  where it ran).
- `Heartbeat`: every rank's liveness counter in torchrun's rendezvous store, bumped by a
  daemon thread. Rank 0 watches the counters and logs a rank that has been silent for half the
  collective timeout (before NCCL's watchdog ends the process without a Python exception); a
  rank whose collective failed reads them to name the rank it was waiting for.
- `session`: the process group for a stage's body, with the heartbeat, re-raising a failure as
  `RanksLost` when other ranks had gone quiet.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from pipeline import distributed
from pipeline.errors import UserError
from pipeline.layout import RANK_QUIET as QUIET, RDZV_ENDPOINT_ENV

log = logging.getLogger("pipeline.distributed")


@contextmanager
def session(backend: str = "auto", timeout_s: int = 1800):
    """`distributed.setup()`, a `Heartbeat` while the body runs, `distributed.teardown()` after it.
    An exception that leaves the body of one of several ranks is raised again as `RanksLost`
    when other ranks stopped answering meanwhile (their nodes named), else as it is."""
    line = node_line()
    if line:
        log.info(line)
    d = distributed.setup(backend, timeout_s)
    beat = Heartbeat.start(d, timeout_s)
    try:
        yield d
    except UserError:
        raise
    except Exception as err:
        lost = beat.lost() if beat else None
        if lost:
            first = (str(err).strip().splitlines() or [""])[0]
            raise RanksLost(f"{lost}; on this rank: {type(err).__name__}: {first}") from err
        raise
    finally:
        if beat:
            beat.stop()
        distributed.teardown()


def node_line(env: dict[str, str] | None = None) -> str | None:
    """`node rank 1 of 2: host sft-n2, address 10.77.77.12, local ranks 0-1 (ranks 2-3), rendezvous
    sft-n1:29400`, for the first rank of each node under torchrun with more than one rank; None
    elsewhere. The address is the one this node reaches the rendezvous from (no packet is sent).
    Torchrun numbers a node's ranks consecutively, from the node's first rank (`RANK` here)."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", 1)) <= 1 or int(env.get("LOCAL_RANK", 0)) != 0 or "GROUP_RANK" not in env:
        return None
    first, local = int(env["RANK"]), int(env.get("LOCAL_WORLD_SIZE", 1))
    endpoint = env.get(RDZV_ENDPOINT_ENV) or f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return (f"node rank {env['GROUP_RANK']} of {env.get('GROUP_WORLD_SIZE', '?')}: host {socket.gethostname()}, "
            f"address {_address_towards(endpoint.rpartition(':')[0])}, local ranks 0-{local - 1} "
            f"(ranks {first}-{first + local - 1}), rendezvous {endpoint}")


class RanksLost(RuntimeError):
    """A collective failed while other ranks had stopped answering: the message names them."""


class Heartbeat:
    """Every rank's liveness in the rendezvous store (torchrun's, MASTER_ADDR:MASTER_PORT, on
    node rank 0).

    A daemon thread adds 1 to the rank's counter every `HEARTBEAT_S`. A rank blocked in a
    collective still beats (the wait releases the GIL); one that is stopped, dead, or cut off
    from the store does not. No clock is compared across nodes: a counter that did not move
    between two reads on one machine is a rank gone quiet. Rank 0's thread also watches every
    counter and logs (once per rank) one that stood still for `watch_s`.
    """

    HEARTBEAT_S = 1.0
    LOST_AFTER_S = 5.0
    PREFIX = "sft/heartbeat"

    def __init__(self, d: distributed.Dist, store, watch_s: float):
        self.d, self.store, self.watch_s = d, store, watch_s
        self.frozen_s = 0.0  # the longest this process itself did not run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="sft-heartbeat", daemon=True)

    @classmethod
    def start(cls, d: distributed.Dist, timeout_s: float) -> Heartbeat | None:
        """None with one rank, or without torchrun's store. Rank 0 reports a rank silent for half
        the collective timeout `timeout_s` (at most a minute)."""
        if not d.enabled or "MASTER_ADDR" not in os.environ:
            return None
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=cls.LOST_AFTER_S))
            where = _address_towards(os.environ["MASTER_ADDR"])
            store.set(f"{cls.PREFIX}/where/{d.rank}",
                      f"{socket.gethostname()} {where} {os.environ.get('GROUP_RANK', '?')}")
            store.add(f"{cls.PREFIX}/{d.rank}", 1)
        except Exception as err:  # a diagnosis aid: training goes on without it
            log.warning("no heartbeat (rendezvous store %s:%s: %s)", os.environ["MASTER_ADDR"],
                        os.environ.get("MASTER_PORT"), err)
            return None
        beat = cls(d, store, min(60.0, max(cls.LOST_AFTER_S, timeout_s / 2)))
        beat._thread.start()
        return beat

    def _beat(self) -> None:
        last = time.monotonic()
        seen: dict[int, tuple[int, float]] = {}  # rank 0: rank -> (its count, when that count was first read)
        while not self._stop.wait(self.HEARTBEAT_S):
            # A long gap between two wake-ups: this process itself did not run (stopped, or starved).
            now = time.monotonic()
            self.frozen_s, last = max(self.frozen_s, now - last - self.HEARTBEAT_S), now
            try:
                self.store.add(f"{self.PREFIX}/{self.d.rank}", 1)
                if self.d.is_main:
                    self._watch(seen, now)
            except Exception:  # the store is gone (its node failed): nothing left to tell
                return

    def _watch(self, seen: dict[int, tuple[int, float]], now: float) -> None:
        for rank in range(1, self.d.world_size):
            count = self.store.add(f"{self.PREFIX}/{rank}", 0)
            if rank not in seen or seen[rank][0] != count:
                seen[rank] = (count, now)
            elif now - seen[rank][1] >= self.watch_s:
                log.warning("%s: rank %d %s (no heartbeat for %.0f s)", self._where(rank), rank, QUIET,
                            now - seen[rank][1])
                seen[rank] = (count, float("inf"))  # said once

    def stop(self) -> None:
        """Stop beating and wait for the thread to be out of its store call before the process group and
        the interpreter go: a daemon thread still inside TCPStore's C++ at exit aborts the rank
        ("terminate called without an active exception", seen once at the end of a 2-rank stage). At
        most one beat plus the store's own timeout."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.HEARTBEAT_S + self.LOST_AFTER_S + 1)

    def lost(self) -> str | None:
        """Which other ranks stopped beating, grouped by node: `node sft-n2 (node rank 1, address
        10.77.77.12): rank 1 stopped answering (no heartbeat for 5 s)`; None when all beat. Said
        first when this rank itself did not run for a while (it was the one that stopped)."""
        said = []
        if self.frozen_s > self.LOST_AFTER_S:
            said.append(f"this rank (rank {self.d.rank}, host {socket.gethostname()}) itself did not run for "
                        f"{self.frozen_s:.0f} s (stopped, or starved of CPU)")
        others = [r for r in range(self.d.world_size) if r != self.d.rank]
        try:
            before = [self.store.add(f"{self.PREFIX}/{r}", 0) for r in others]
            time.sleep(self.LOST_AFTER_S)
            after = [self.store.add(f"{self.PREFIX}/{r}", 0) for r in others]
            quiet = [r for r, a, b in zip(others, before, after) if a == b]
            where = {r: self._where(r) for r in quiet}
        except Exception:
            host = os.environ.get("MASTER_ADDR")
            said.append(f"the rendezvous store on {host} (node rank 0) does not answer: node {host} stopped or "
                        "is cut off from this one")
            return "; ".join(said)
        nodes: dict[str, list[int]] = {}
        for r in quiet:
            nodes.setdefault(where[r], []).append(r)
        said += [f"{node}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {QUIET} "
                 f"(no heartbeat for {self.LOST_AFTER_S:.0f} s)" for node, ranks in nodes.items()]
        return "; ".join(said) or None

    def _where(self, rank: int) -> str:
        key = f"{self.PREFIX}/where/{rank}"
        if not self.store.check([key]):
            return "a node that never joined"
        host, address, node_rank = self.store.get(key).decode().split()
        return f"node {host} (node rank {node_rank}, address {address})"


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (a UDP socket's connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "unknown"
