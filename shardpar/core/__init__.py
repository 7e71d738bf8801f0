"""Layer 2: flat buffers and the parts every stage is composed of."""
