"""The host ComfyUI: finding and importing it (the only ``sys.path`` change), its tested versions, the pinned copy,
and every patch of ComfyUI's own code."""
