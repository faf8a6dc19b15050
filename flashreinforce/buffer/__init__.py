"""Schedulers (sync, april, urb, stream) and the exactly-once ledger: pure state machines over rollouts.

Imports only flashreinforce.types and the standard library. See scheduler.py for the protocol the
controller drives and what it must do at a checkpoint.
"""

from flashreinforce.buffer.april import mask_offpolicy_prefix
from flashreinforce.buffer.book import RolloutTask
from flashreinforce.buffer.ledger import Ledger
from flashreinforce.buffer.scheduler import SCHEDULERS, Scheduler, build_scheduler, scheduler_options

__all__ = ["SCHEDULERS", "Ledger", "RolloutTask", "Scheduler", "build_scheduler", "mask_offpolicy_prefix",
           "scheduler_options"]
