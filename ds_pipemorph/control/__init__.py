"""The control plane, pure Python (no torch, no deepspeed): link delays from message times
(``estimate``), straggler detection (``detector``) and the policy that turns one iteration's
measurements into a ``Decision`` (``policy``); the runtime only gathers and applies."""
