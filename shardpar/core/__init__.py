"""Layer 2: flat buffers and the parts every stage is composed of.

[Note: shardpar tensors]
The tensors the parts hold, by name, and which ``.data`` is which:

- **compute buffer** -- ``ParamBuffer.data`` (stages 0-2; core/replicated.py): one 1-D tensor per
  dtype in the compute dtype (bf16 under mixed precision), padded per bucket; every trainable
  parameter's ``param.data`` is a view into it. At stage 3 the same role is a flat group's
  ``FlatParamGroup.full`` (core/flat_param.py), whose storage exists only while the unit is
  gathered.
- **master** -- the full-precision values the optimizer updates, held by the storage's master
  part (core/masters.py): the compute buffer itself at full precision, else
  ``FullMaster.copies[buf]`` (stage 0, copied into the compute buffer after each step) or
  ``ShardedMaster.shards[buf]`` (stages 1-2: this rank's slice of every bucket, all-gathered
  back by the master's post-step gatherer); ``FullMaster.values(buf)`` is whichever holds the
  full values. Frozen parameters under mixed precision keep theirs in
  ``ReplicatedStorage.frozen_masters``.
- **shard** -- ``FlatParamGroup.shard`` (stage 3; and the bucket groups of stages 1-2 as views):
  slice r of a padded flat buffer, the only persistent copy of a stage-3 parameter.
- **gradient buffer** -- ``_FullGradBuffer.grad_buffers`` (stages 0-1; core/reduce_strategies.py):
  one full gradient buffer per bucketed parameter set in the reduce dtype, which ``param.grad`` views
  where the dtypes agree; ``master_grads`` / ``master_grad_shards`` hold the reduced gradients in
  the master dtype where they do not.
- **staging** -- ``StagedReduceScatter``'s pool (stages 2-3; core/staged_reduce_scatter.py): a
  bucket's full-size gradients, bounded in bytes, reduce-scattered into the **gradient shard**
  (``grad_shards``) and returned to the pool.
- **placeholders** -- where values are not: at stages 1-3 (and stage 0 under mixed
  precision) ``param.grad`` after a backward is a ``ShardedGrad`` that raises when read
  (core/grad_placeholders.py), since only the owned slice exists. (A stage-3 parameter
  between gathers needs none: it is its view of the freed full buffer, behind a guarded
  class, core/param_guard.py.)
- **full values** -- what ``model.gathered()`` and state dicts show in the parameters for a
  while (facade/module_state.py, [Note: full values in the module]): the live tensors at stage
  0, the masters under mixed precision, assembled copies at stages 1-3.
"""
