"""Megatron-Core's rules as pure values: no megatron-core import, no process group.

What each megatron-core release offers (:mod:`hypergrid.megatron.spec.features`), its
``initialize_model_parallel`` keywords checked as it checks them
(:mod:`hypergrid.megatron.spec.config`), and every group it makes, as kinds
(:mod:`hypergrid.megatron.spec.plan`). The adapter above creates from these; the planning tool
counts and draws them.

Example::

    >>> from hypergrid.megatron.spec.plan import plan_model_parallel
    >>> plan_model_parallel(8, tensor_model_parallel_size=2).rank_group("tp", 5)
    [4, 5]
"""
