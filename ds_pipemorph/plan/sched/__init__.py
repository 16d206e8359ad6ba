"""Making schedules: the list scheduler (``listsched``, over ``sim.listsched_py`` or the compiled core),
warm-ups, baselines, the search with its local improvement, justification and exact MILP, lower
bounds (``bounds``), link tolerances and delegation queue counts."""
