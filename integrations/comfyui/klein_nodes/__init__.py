"""klein's ComfyUI nodes: a workflow's generation sent to a running `klein serve` (docs/comfyui.md).
Copy or link this folder into ComfyUI's custom_nodes/; it needs nothing beyond what ComfyUI has."""

from .nodes import NAMES, NODES

NODE_CLASS_MAPPINGS = NODES
NODE_DISPLAY_NAME_MAPPINGS = NAMES
