"""Public ops: argument checks with messages that name the value, then dispatch to a tier."""
