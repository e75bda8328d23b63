"""jaxinfer: experiments (see DESIGN.md)."""
