"""One registry per scheduling seam (``scheduler_cls``, ``scheduling_policy``): the names ``EngineConfig`` checks
(``config.SCHEDULERS``, ``config.SCHEDULING_POLICIES``) mapped to what they build, and ``make_scheduler``, which the
engine core and the lab's simulator call."""

from __future__ import annotations

from tinypaged.interfaces import ORDER_REQUIRED, POLICY_REQUIRED, require
from tinypaged.sched.policies import FcfsOrder, PlanPolicy, PriorityOrder
from tinypaged.sched.radix_policy import CacheAwareOrder
from tinypaged.sched.scheduler import Scheduler
from tinypaged.sched.static import StaticScheduler

# scheduler_cls's names -> the scheduler class
SCHEDULERS = {"static": StaticScheduler}
# scheduling_policy's names -> the order
ORDERS = {"fcfs": FcfsOrder, "priority": PriorityOrder, "lpm": lambda: CacheAwareOrder("lpm")}


def make_scheduler(config, kv_manager, **kwargs) -> Scheduler:
    """The scheduler that ``config.scheduler_cls`` and ``config.scheduling_policy`` name (``EngineConfig.verify`` has
    checked both; old spellings are errors there). ``scheduler_cls``: None (the engine's continuous step,
    ``schedule_step``), "static" (``StaticScheduler``), a ``Scheduler`` subclass (vLLM's meaning of the knob), or a
    plug-in step: a ``schedule_step``-like function, or an object (or class) with ``plan``. ``scheduling_policy``:
    a name in ``ORDERS`` or an order object (``WaitingOrder``: a ``CacheAwareOrder`` around a learner's order)."""
    cls, step = config.scheduler_cls, None
    if isinstance(cls, str):
        cls = SCHEDULERS[cls]
    elif cls is None or not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        step, cls = cls, Scheduler
        if isinstance(step, type):
            step = step()
        if step is not None and not callable(getattr(step, "plan", None)):
            step = PlanPolicy(step)
    order = config.scheduling_policy
    if isinstance(order, str):
        order = ORDERS[order]()
    require(order, ORDER_REQUIRED, "scheduling_policy")
    if step is not None:
        require(step, POLICY_REQUIRED, "scheduler_cls")
    return cls(config, kv_manager, step=step, order=order, **kwargs)
