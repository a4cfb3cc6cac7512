"""Loading and launching code objects: driver bindings, discovery, selection per device."""
