"""DeepSpeed runtime of ds_pipemorph: plans lowered to pipe instructions and executed by PipeMorphEngine."""
