"""``pipemorph bench``: the real engines side by side on this machine (emulated compute, injected delays)."""
