"""Scheduling: the ``Scheduler`` (owner of the queues and of ``Sequence`` state), the policies (continuous,
static, longest-prefix-first) and ``SchedulerOutput``, the step's typed hand-off (vLLM v1's ``v1/core/sched``)."""
