"""Process groups that a restarting launcher can form again: one key space per restart round.

torchrun (and ``accelerate launch``, which runs it) keeps its own key-value store alive across
the rounds of ``--max-restarts``: the static rendezvous creates it once, and torch's ``env://``
rendezvous hands every round a client of that same store without a per-round prefix. Gloo
finds its peers through addresses published under fixed keys there, so a restarted worker can
read the address a dead worker of the previous round published and connect to nothing
("Gloo connectFullMesh failed ... Connection refused"), or hang until the group's timeout in a
later ``new_group``. Whether it does depends on which rank publishes first: a race.

`round_store` gives each round its own prefix of the launcher's store, so a restarted round
never reads the previous one's keys; `hf_zero.comm.topology.init_distributed` builds the
default group on it whenever hf_zero creates that group under such a launcher.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)
_built_here = False

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun in every worker: how many times the launcher has restarted the workers."""


def restart_count() -> int:
    """How many times the launcher has restarted this job's workers (0 on a first start, and
    for a process no elastic launcher started)."""
    try:
        return int(os.environ.get(RESTART_COUNT, "0"))
    except ValueError:
        return 0


def uses_agent_store() -> bool:
    """Whether the launcher hosts the job's key-value store (torchrun's workers are clients)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def round_store(timeout: timedelta) -> dist.Store:
    """A client of the launcher's store, with this restart round's own key prefix."""
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    global _built_here
    _built_here = True
    return dist.PrefixStore(f"hf_zero/round_{restart_count()}", store)


def warn_if_shared_store() -> None:
    """In a restarted round, say so when the default group was built on the launcher's shared
    store by someone else (torch, Accelerate): hf_zero's own groups may then not form."""
    if restart_count() > 0 and uses_agent_store() and not _built_here:
        logger.warning(
            "hf_zero: restart round %d, and the default process group was created before hf_zero "
            "on the launcher's store, which keeps the previous round's keys: joining may fail "
            "('Connection refused'). Launch with -m hf_zero.run, or build ZeroTrainingArguments / "
            "ZeroAccelerator before anything else creates the group",
            restart_count(),
        )
