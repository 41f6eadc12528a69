"""FP8 numerics: formats, scaling granularities, quantization and error metrics."""

from .formats import E4M3, E4M3FNUZ, E5M2, E5M2FNUZ, FORMATS, FP8Format, get_format
from .metrics import (MERE_FLOOR, METRICS, mere, mere_denominator, relative_frobenius,
                      rowwise_relative_error, sqnr)
from .delayed import check_decay, delayed_scale, new_state, next_state, quantize_delayed, seed_state
from .scaling import (AMAX_EPS, BLOCK, FLOAT32_MAX, MX_BLOCK, Granularity, QTensor, as_granularity,
                      compute_scales, dequantize, fake_quantize, in_memory_order, is_fp8_dtype,
                      operand_block, quantize, requantize_transposed, round_scale_to_power_of_two,
                      saturate_float64)

__all__ = [
    "FP8Format", "E4M3", "E5M2", "E4M3FNUZ", "E5M2FNUZ", "FORMATS", "get_format",
    "Granularity", "as_granularity", "QTensor", "quantize", "dequantize", "fake_quantize",
    "requantize_transposed", "compute_scales", "operand_block", "in_memory_order",
    "round_scale_to_power_of_two", "saturate_float64", "is_fp8_dtype", "AMAX_EPS",
    "FLOAT32_MAX", "BLOCK", "MX_BLOCK", "mere", "mere_denominator", "sqnr",
    "relative_frobenius", "rowwise_relative_error", "METRICS", "MERE_FLOOR",
    "quantize_delayed", "next_state", "seed_state", "new_state", "delayed_scale",
    "check_decay",
]
