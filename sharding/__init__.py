"""jaxinfer: sharding (see DESIGN.md)."""
