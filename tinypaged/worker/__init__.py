"""The worker: ``ModelRunner`` turns a ``SchedulerOutput`` into one forward pass on the device and owns the KV
tensors (vLLM v1's ``v1/worker``)."""
