"""jaxinfer: sampling (see DESIGN.md)."""
