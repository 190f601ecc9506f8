"""The offline planning tool: what a layout will do before it runs, with no process group.

A :class:`~hypergrid.planning.plan.Plan` holds a layout's kinds of groups, counts and node
locality (:mod:`hypergrid.planning.plan`); it is shown as a table or CSV
(:mod:`hypergrid.planning.text`), costed in communicators and memory
(:mod:`hypergrid.planning.cost`), drawn (:mod:`hypergrid.planning.viz`, matplotlib) and compared
with Megatron-Core's own enumeration (:mod:`hypergrid.planning.parity`). Plans come from
hypergrid's sizes, a Megatron-LM launch line (:mod:`hypergrid.planning.megatron_args`) or a
torchtitan job config (:mod:`hypergrid.planning.torchtitan`). Nothing here imports torch.

Example::

    >>> from hypergrid.planning.plan import plan_megatron
    >>> plan_megatron(8, tp=2, pp=2).groups_of(5)["dp"]
    [5, 7]
"""
