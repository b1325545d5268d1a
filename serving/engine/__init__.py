"""The serving engine's parts: block allocator (with its host/disk tiers), requests, sampler, continuous-batching
scheduler and model runner. ``serving.llm_engine.Engine`` drives them (and ``serving.spec_decode``, which builds on
them); nothing here imports either.

Data flow per step: ``Scheduler.schedule`` picks which sequences run and how many tokens each (allocating
cache blocks from ``BlockAllocator``) -> ``ModelRunner.run`` does one jitted device call (forward + sampler)
-> ``Scheduler.update`` appends the sampled tokens, detokenizes and applies the stop conditions.
"""
