"""Control plane logic that needs no torch: straggler detection and re-plan decisions."""
