"""The serving engine: block allocator, sampler, continuous-batching scheduler, model runner, the speculative
verification step (``spec_step.py``, over ``serving.spec_decode``) and ``Engine``.

Data flow per step: ``Scheduler.schedule`` picks which sequences run and how many tokens each (allocating
cache blocks from ``BlockAllocator``) -> ``ModelRunner.run`` does one jitted device call (forward + sampler)
-> ``Scheduler.update`` appends the sampled tokens, detokenizes and applies the stop conditions.
"""
