"""Compression of the tensors learners and the syncer exchange: codecs and error feedback."""

from diloco.codecs.base import Codec
from diloco.codecs.blockwise import DEFAULT_BLOCK, SCALE_BYTES, BlockCodec
from diloco.codecs.cast import CastCodec
from diloco.codecs.encoded import TENSOR_HEADER_BYTES, Encoded
from diloco.codecs.error_feedback import ErrorFeedback
from diloco.codecs.fp4 import E3M0Codec
from diloco.codecs.integer import IntCodec
from diloco.codecs.registry import CODEC_NAMES, get_codec

__all__ = ["Codec", "BlockCodec", "CastCodec", "IntCodec", "E3M0Codec", "Encoded", "ErrorFeedback", "get_codec",
           "CODEC_NAMES", "DEFAULT_BLOCK", "SCALE_BYTES", "TENSOR_HEADER_BYTES"]
