"""Optional adapters to other systems. Nothing here is imported by ``import warmlink``; each
submodule imports its system (Ray, ...) only when a function that needs it is called."""
