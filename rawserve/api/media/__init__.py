"""Image inputs on the server side: where their bytes come from (sources), how they decode (decode, Pillow),
how the checkpoint sizes them (processor) and the limits a request meets (reader). No torch here."""
from __future__ import annotations

from rawserve.api.media.decode import EXTRA_HINT
from rawserve.api.media.processor import IMAGE_PLACEHOLDER, ImageProcessorRules, ProcessorConfigError
from rawserve.api.media.reader import ImagePart, ImageReader, MediaLimits
from rawserve.api.media.sources import SourcePolicy

__all__ = ["EXTRA_HINT", "IMAGE_PLACEHOLDER", "ImagePart", "ImageProcessorRules", "ImageReader", "MediaLimits",
           "ProcessorConfigError", "SourcePolicy"]
