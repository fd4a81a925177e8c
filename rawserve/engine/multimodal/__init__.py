"""Image input inside the core: preprocessing (pixels -> patches), the encoder cache, M-RoPE positions and the
manager that runs the vision tower for a step. The server's side of images stops at engine/mm_inputs.py."""
