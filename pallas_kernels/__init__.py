"""jaxinfer: pallas_kernels (see DESIGN.md)."""
