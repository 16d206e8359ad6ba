"""Point-to-point messages between neighbouring pipeline stages.

- ``protocol``: the contract every transport keeps (``Transport``), what the router offers the control
  loop (``LinkControl``), the errors, and ``link_of``, the one rule for which link a message uses;
- ``header``: the layout header of a message, shared by both transports;
- ``direct``: ``DirectTransport``, torch.distributed point-to-point in the training process;
- ``delegated``: ``DelegatedTransport``, staging rings drained by delegate processes;
- ``router``: ``LinkRouter`` and ``build_transport``, each link direction on its current path, with failover.

Nothing is imported here: import each name from its module (``protocol`` needs no torch).
"""
