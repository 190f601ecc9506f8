"""The runtime: the only code that makes, shares and destroys process groups.

A grid's request for a group comes here as one :class:`~hypergrid.runtime.registry.GroupRequest`;
the registry (:mod:`hypergrid.runtime.registry`) hands out an identical existing group or makes
a new one with the creation mode the job needs (:mod:`hypergrid.runtime.modes`), after the
members have checked through the job's store that they asked for the same thing
(:mod:`hypergrid.runtime.agreement`). torch's private names are used in two modules only,
:mod:`hypergrid.runtime.torch_compat` and :mod:`hypergrid.runtime.mesh_compat`.

Example, with no process group (nothing splits, so every mode is member-only or Megatron-Core's)::

    >>> from hypergrid.runtime.modes import creation_mode
    >>> creation_mode("auto").value, creation_mode("enumerate").value
    ('local', 'enumerate')
"""
