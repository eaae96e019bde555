"""What the tools that draw share: the image formats matplotlib can write."""
from __future__ import annotations

import os


def image_path_error(path: str) -> str | None:
    """None when matplotlib can write `path` (judged by its suffix), else the one-line reason."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if os.path.splitext(path)[1][1:].lower() in formats:
        return None
    return f"{path}: matplotlib writes only {', '.join('.' + f for f in formats)}"
