"""The runtime every dimension shares: collectives, the dim-0 pairs, rollback, agreement, replicas, grad hooks, the
list of what a wrap installs outside the model (`process_hooks`), the slot guard.

It imports the mesh, the state, planning and compat; never a dimension package, io or the integrations.
"""
