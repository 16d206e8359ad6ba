"""The ``pipemorph`` command (Typer): plan, simulate, and the tools around them."""
